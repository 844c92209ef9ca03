//! From the metrics' proposal to the count the target is scaled to: stabilization
//! over past recommendations, then the scaling rate (the `behavior` policies, or
//! Kubernetes' fixed rule without one), then min and max — as Kubernetes'
//! `normalizeDesiredReplicas` and `normalizeDesiredReplicasWithBehaviors`.
//!
//! Kubernetes keeps the recommendations and scale events in the controller's
//! memory. A plugin's instances come and go, so here they live in an annotation of
//! the HorizontalPodAutoscaler ([`History`]), which also outlives a restart.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The annotation the history is kept in.
pub const HISTORY_ANNOTATION: &str = "autoscaling.trellis.dev/history";

/// What past syncs leave for the next: `[time ms, value]` pairs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct History {
    /// When the last sync ran, in milliseconds since the epoch: syncs of one
    /// autoscaler are at least a sync period apart, however often it changes.
    #[serde(default)]
    pub last_sync: i64,
    /// Recommendations (unstabilized desired counts).
    #[serde(default)]
    pub recommendations: Vec<(i64, i32)>,
    /// Scale-ups: `(time, replicas added, outdated)`.
    #[serde(default)]
    pub scale_up: Vec<(i64, i32, bool)>,
    /// Scale-downs: `(time, replicas removed, outdated)`.
    #[serde(default)]
    pub scale_down: Vec<(i64, i32, bool)>,
}

impl History {
    pub fn of(hpa: &Value) -> Self {
        hpa["metadata"]["annotations"][HISTORY_ANNOTATION]
            .as_str()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default()
    }
}

/// One direction's rules, defaulted.
#[derive(Clone, Debug, PartialEq)]
pub struct Rules {
    pub stabilization_seconds: i64,
    /// `Max`, `Min` or `Disabled`.
    pub select: String,
    /// `(type, value, periodSeconds)`.
    pub policies: Vec<(String, i32, i64)>,
}

impl Rules {
    /// `spec.behavior.scaleUp`/`scaleDown` with what is unset from Kubernetes'
    /// defaults; a scale-down without a window takes `default_window`
    /// (`--horizontal-pod-autoscaler-downscale-stabilization`).
    pub fn of(rules: &Value, up: bool, default_window: i64) -> Self {
        let policies = match rules["policies"].as_array() {
            Some(p) => p
                .iter()
                .map(|p| {
                    (
                        p["type"].as_str().unwrap_or("Pods").to_owned(),
                        p["value"]
                            .as_i64()
                            .and_then(|v| i32::try_from(v).ok())
                            .unwrap_or(0),
                        p["periodSeconds"].as_i64().unwrap_or(15),
                    )
                })
                .collect(),
            None if up => vec![("Pods".into(), 4, 15), ("Percent".into(), 100, 15)],
            None => vec![("Percent".into(), 100, 15)],
        };
        Self {
            stabilization_seconds: rules["stabilizationWindowSeconds"]
                .as_i64()
                .unwrap_or(if up { 0 } else { default_window }),
            select: rules["selectPolicy"].as_str().unwrap_or("Max").to_owned(),
            policies,
        }
    }

    fn longest_period(&self) -> i64 {
        self.policies.iter().map(|p| p.2).max().unwrap_or(0)
    }
}

/// What a normalization decided, with the conditions it explains itself by.
#[derive(Clone, Debug, PartialEq)]
pub struct Normalized {
    pub desired: i32,
    /// `AbleToScale`: `(reason, message)`, status True.
    pub able: (&'static str, &'static str),
    /// `ScalingLimited`: `(limited, reason, message)`.
    pub limited: (bool, &'static str, &'static str),
}

/// Limits Kubernetes applies without a `behavior`: a scale-down only to the
/// highest recommendation within the window, a scale-up to at most twice the pods
/// (at least 4).
pub fn normalize(
    history: &mut History,
    now: i64,
    window_seconds: i64,
    current: i32,
    proposed: i32,
    min: i32,
    max: i32,
) -> Normalized {
    let cutoff = now - window_seconds * 1000;
    let mut stabilized = proposed;
    let mut old = None;
    for (i, (at, recommendation)) in history.recommendations.iter().enumerate() {
        if *at < cutoff {
            old = Some(i);
        } else if *recommendation > stabilized {
            stabilized = *recommendation;
        }
    }
    record(&mut history.recommendations, old, (now, proposed));
    let able = if stabilized == proposed {
        ("ReadyForNewScale", "recommended size matches current size")
    } else {
        (
            "ScaleDownStabilized",
            "recent recommendations were higher than current one, applying the highest recent recommendation",
        )
    };
    let scale_up_limit = (2 * current).max(4);
    let (maximum, reason, message) = if max > scale_up_limit {
        (
            scale_up_limit,
            "ScaleUpLimit",
            "the desired replica count is increasing faster than the maximum scale rate",
        )
    } else {
        (
            max,
            "TooManyReplicas",
            "the desired replica count is more than the maximum replica count",
        )
    };
    let (desired, reason, message) = if stabilized < min {
        (
            min,
            "TooFewReplicas",
            "the desired replica count is less than the minimum replica count",
        )
    } else if stabilized > maximum {
        (maximum, reason, message)
    } else {
        (
            stabilized,
            "DesiredWithinRange",
            "the desired count is within the acceptable range",
        )
    };
    Normalized {
        desired,
        able,
        limited: (desired != stabilized, reason, message),
    }
}

/// Limits of a `behavior`: the count held between the lowest recommendation of the
/// scale-up window and the highest of the scale-down window, then moved no faster
/// than the policies allow over their periods, then kept within min and max.
#[allow(clippy::too_many_arguments)]
pub fn normalize_with_behavior(
    history: &mut History,
    now: i64,
    up: &Rules,
    down: &Rules,
    current: i32,
    proposed: i32,
    min: i32,
    max: i32,
) -> Normalized {
    let up_cutoff = now - up.stabilization_seconds * 1000;
    let down_cutoff = now - down.stabilization_seconds * 1000;
    let (mut up_recommendation, mut down_recommendation) = (proposed, proposed);
    let mut old = None;
    for (i, (at, recommendation)) in history.recommendations.iter().enumerate() {
        if *at > up_cutoff {
            up_recommendation = up_recommendation.min(*recommendation);
        }
        if *at > down_cutoff {
            down_recommendation = down_recommendation.max(*recommendation);
        }
        if *at < up_cutoff && *at < down_cutoff {
            old = Some(i);
        }
    }
    let stabilized = current.max(up_recommendation).min(down_recommendation);
    record(&mut history.recommendations, old, (now, proposed));
    let able = if stabilized == proposed {
        ("ReadyForNewScale", "recommended size matches current size")
    } else if proposed >= current {
        (
            "ScaleUpStabilized",
            "recent recommendations were lower than current one, applying the lowest recent recommendation",
        )
    } else {
        (
            "ScaleDownStabilized",
            "recent recommendations were higher than current one, applying the highest recent recommendation",
        )
    };
    let (desired, reason, message) =
        rate_limited(history, now, up, down, current, stabilized, min, max);
    Normalized {
        desired,
        able,
        limited: (desired != stabilized, reason, message),
    }
}

#[allow(clippy::too_many_arguments)]
fn rate_limited(
    history: &History,
    now: i64,
    up: &Rules,
    down: &Rules,
    current: i32,
    desired: i32,
    min: i32,
    max: i32,
) -> (i32, &'static str, &'static str) {
    if desired > current {
        let limit = scale_up_limit(history, now, up, current).max(current);
        let (maximum, reason, message) = if max > limit {
            (
                limit,
                "ScaleUpLimit",
                "the desired replica count is increasing faster than the maximum scale rate",
            )
        } else {
            (
                max,
                "TooManyReplicas",
                "the desired replica count is more than the maximum replica count",
            )
        };
        if desired > maximum {
            return (maximum, reason, message);
        }
    } else if desired < current {
        let limit = scale_down_limit(history, now, down, current).min(current);
        let (minimum, reason, message) = if min < limit {
            (
                limit,
                "ScaleDownLimit",
                "the desired replica count is decreasing faster than the maximum scale rate",
            )
        } else {
            (
                min,
                "TooFewReplicas",
                "the desired replica count is less than the minimum replica count",
            )
        };
        if desired < minimum {
            return (minimum, reason, message);
        }
    }
    (
        desired,
        "DesiredWithinRange",
        "the desired count is within the acceptable range",
    )
}

/// Replicas added (or removed) by the events within the last `period` seconds.
fn changed_within(events: &[(i64, i32, bool)], now: i64, period: i64) -> i32 {
    let cutoff = now - period * 1000;
    events
        .iter()
        .filter(|(at, _, _)| *at > cutoff)
        .map(|(_, change, _)| change)
        .sum()
}

fn scale_up_limit(history: &History, now: i64, rules: &Rules, current: i32) -> i32 {
    if rules.select == "Disabled" {
        return current;
    }
    let proposals = rules.policies.iter().map(|(kind, value, period)| {
        let start = current - changed_within(&history.scale_up, now, *period)
            + changed_within(&history.scale_down, now, *period);
        if kind == "Percent" {
            (f64::from(start) * (1.0 + f64::from(*value) / 100.0)).ceil() as i32
        } else {
            start + value
        }
    });
    if rules.select == "Min" {
        proposals.min().unwrap_or(i32::MAX)
    } else {
        proposals.max().unwrap_or(i32::MIN)
    }
}

fn scale_down_limit(history: &History, now: i64, rules: &Rules, current: i32) -> i32 {
    if rules.select == "Disabled" {
        return current;
    }
    let proposals = rules.policies.iter().map(|(kind, value, period)| {
        let start = current - changed_within(&history.scale_up, now, *period)
            + changed_within(&history.scale_down, now, *period);
        if kind == "Percent" {
            (f64::from(start) * (1.0 - f64::from(*value) / 100.0)) as i32
        } else {
            start - value
        }
    });
    // The least change is the highest count.
    if rules.select == "Min" {
        proposals.max().unwrap_or(i32::MIN)
    } else {
        proposals.min().unwrap_or(i32::MAX)
    }
}

/// Records a rescale from `from` to `to` replicas against the policies' periods,
/// reusing the slot of an event older than the longest of them.
pub fn record_scale(history: &mut History, now: i64, up: &Rules, down: &Rules, from: i32, to: i32) {
    let (events, rules, change) = if to > from {
        (&mut history.scale_up, up, to - from)
    } else {
        (&mut history.scale_down, down, from - to)
    };
    let cutoff = now - rules.longest_period() * 1000;
    for event in events.iter_mut() {
        if event.0 < cutoff {
            event.2 = true;
        }
    }
    let old = events.iter().position(|e| e.2);
    match old {
        Some(i) => events[i] = (now, change, false),
        None => events.push((now, change, false)),
    }
}

fn record(recommendations: &mut Vec<(i64, i32)>, old: Option<usize>, new: (i64, i32)) {
    match old {
        Some(i) => recommendations[i] = new,
        None => recommendations.push(new),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: i64 = 10_000_000;

    #[test]
    fn without_behavior_a_scale_down_waits_for_the_window() {
        let mut history = History {
            recommendations: vec![(NOW - 10_000, 5), (NOW - 400_000, 9)],
            ..History::default()
        };
        let n = normalize(&mut history, NOW, 300, 5, 2, 1, 10);
        // The 5 of ten seconds ago holds; the 9 is older than the window and its
        // slot takes the new recommendation.
        assert_eq!(n.desired, 5);
        assert_eq!(n.able.0, "ScaleDownStabilized");
        assert_eq!(history.recommendations, vec![(NOW - 10_000, 5), (NOW, 2)]);
        // A scale-up goes at most to twice the pods (at least four).
        let n = normalize(&mut History::default(), NOW, 300, 3, 20, 1, 10);
        assert_eq!(
            (n.desired, n.limited),
            (
                6,
                (
                    true,
                    "ScaleUpLimit",
                    "the desired replica count is increasing faster than the maximum scale rate"
                )
            )
        );
        let n = normalize(&mut History::default(), NOW, 300, 3, 0, 2, 10);
        assert_eq!((n.desired, n.limited.1), (2, "TooFewReplicas"));
    }

    #[test]
    fn behavior_policies_limit_the_rate_over_their_periods() {
        let up = Rules::of(
            &json!({"policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}),
            true,
            300,
        );
        let down = Rules::of(&json!({"stabilizationWindowSeconds": 0}), false, 300);
        assert_eq!(down.policies, vec![("Percent".into(), 100, 15)]);
        let mut history = History::default();
        let n = normalize_with_behavior(&mut history, NOW, &up, &down, 2, 8, 1, 10);
        assert_eq!((n.desired, n.limited.1), (3, "ScaleUpLimit"));
        record_scale(&mut history, NOW, &up, &down, 2, 3);
        // Within the same minute the one pod allowed has been added.
        let n = normalize_with_behavior(&mut history, NOW + 5_000, &up, &down, 3, 8, 1, 10);
        assert_eq!(n.desired, 3);
        // A minute later one more.
        let n = normalize_with_behavior(&mut history, NOW + 61_000, &up, &down, 3, 8, 1, 10);
        assert_eq!(n.desired, 4);
        // Disabled scale-downs keep the count.
        let disabled = Rules::of(
            &json!({"selectPolicy": "Disabled", "stabilizationWindowSeconds": 0}),
            false,
            300,
        );
        let n = normalize_with_behavior(&mut History::default(), NOW, &up, &disabled, 5, 1, 1, 10);
        assert_eq!((n.desired, n.limited.1), (5, "ScaleDownLimit"));
    }

    #[test]
    fn behavior_windows_hold_the_count_between_recent_recommendations() {
        let up = Rules::of(&json!({"stabilizationWindowSeconds": 60}), true, 300);
        let down = Rules::of(&json!({}), false, 30);
        let mut history = History {
            recommendations: vec![(NOW - 20_000, 4), (NOW - 50_000, 6)],
            ..History::default()
        };
        // Down: the highest within the 30 s window (4) wins over the new 2.
        let n = normalize_with_behavior(&mut history.clone(), NOW, &up, &down, 5, 2, 1, 10);
        assert_eq!((n.desired, n.able.0), (4, "ScaleDownStabilized"));
        // Up: the lowest within the 60 s window (4) holds a jump to 9 at the current 5.
        let n = normalize_with_behavior(&mut history, NOW, &up, &down, 5, 9, 1, 10);
        assert_eq!((n.desired, n.able.0), (5, "ScaleUpStabilized"));
        assert_eq!(history.recommendations.len(), 3);
        assert_eq!(down.stabilization_seconds, 30);
    }
}
