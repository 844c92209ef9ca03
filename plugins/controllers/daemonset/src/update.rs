//! The RollingUpdate strategy (Kubernetes' `rollingUpdate`): old pods are deleted
//! within `maxUnavailable` (the main pass then creates their replacements), or, with
//! `maxSurge`, new pods start beside old ones and the old ones go once the new ones
//! are available.

use serde_json::Value;

use crate::{Plan, Pod, View, fit};

/// A count or a percentage of `total`, rounded up (`GetScaledValueFromIntOrPercent`).
fn scaled(value: &Value, total: i64) -> Result<i64, String> {
    match value {
        Value::Null => Ok(0),
        Value::Number(n) => n.as_i64().ok_or_else(|| format!("{n}: not an integer")),
        Value::String(s) => {
            let pct: i64 = s
                .strip_suffix('%')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("{s:?}: not a count or a percentage"))?;
            Ok((pct * total + 99) / 100)
        }
        other => Err(format!("{other}: not a count or a percentage")),
    }
}

/// `(maxSurge, maxUnavailable)` for `desired` nodes; both 0 would never progress,
/// so one may then be unavailable.
pub fn counts(ds: &Value, desired: i64) -> Result<(i64, i64), String> {
    let rolling = &ds["spec"]["updateStrategy"]["rollingUpdate"];
    let surge = scaled(&rolling["maxSurge"], desired).map_err(|e| format!("maxSurge: {e}"))?;
    let unavailable = match rolling.get("maxUnavailable") {
        Some(v) => scaled(v, desired).map_err(|e| format!("maxUnavailable: {e}"))?,
        None => 1,
    };
    if desired > 0 && surge == 0 && unavailable == 0 {
        return Ok((0, 1));
    }
    Ok((surge, unavailable))
}

/// The node's one new and one old pod; `None` when it has more (the main pass
/// prunes them first).
fn split<'a>(pods: &[&'a Pod], view: &View) -> Option<(Option<&'a Pod>, Option<&'a Pod>)> {
    let (mut new, mut old) = (None, None);
    for p in pods {
        let slot = if p.is_updated(&view.hash, view.generation.as_deref()) {
            &mut new
        } else {
            &mut old
        };
        if slot.is_some() {
            return None;
        }
        *slot = Some(*p);
    }
    Some((new, old))
}

pub fn rolling_update(view: &View, plan: &mut Plan) -> Result<(), String> {
    let spec = view.template_spec();
    let min_ready = view.min_ready();
    let now = view.now;
    let mut by_node: Vec<(&str, Vec<&Pod>)> = view
        .by_node
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    let mut desired = 0;
    for node in view.nodes {
        if fit::should_run(&spec, node).0 {
            desired += 1;
            if !view.by_node.contains_key(&node.metadata.name) {
                by_node.push((node.metadata.name.as_str(), Vec::new()));
            }
        }
    }
    let (max_surge, max_unavailable) = counts(view.ds, desired)?;
    let available = |p: &Pod, plan: &mut Plan| match p.available(min_ready, now) {
        Ok(a) => a,
        Err(wait) => {
            plan.recheck_in(wait);
            false
        }
    };
    let delete = |plan: &mut Plan, p: &Pod| {
        plan.delete
            .push((p.metadata.name.clone(), p.metadata.uid.clone()));
    };

    if max_surge == 0 {
        let mut unavailable = 0;
        let mut replace: Vec<&Pod> = Vec::new();
        let mut candidates: Vec<&Pod> = Vec::new();
        for (_, pods) in &by_node {
            let Some((new, old)) = split(pods, view) else {
                unavailable += 1;
                continue;
            };
            match (new, old) {
                (None, None) | (Some(_), Some(_)) => unavailable += 1,
                (Some(new), None) => {
                    if !available(new, plan) {
                        unavailable += 1;
                    }
                }
                (None, Some(old)) => {
                    if !available(old, plan) {
                        replace.push(old);
                        unavailable += 1;
                    } else if unavailable < max_unavailable {
                        candidates.push(old);
                    }
                }
            }
        }
        let room = (max_unavailable - unavailable).clamp(0, candidates.len() as i64) as usize;
        for p in replace.into_iter().chain(candidates.into_iter().take(room)) {
            delete(plan, p);
        }
        return Ok(());
    }

    let mut surged = 0;
    let mut num_available = 0;
    let mut allowed: Vec<&str> = Vec::new();
    let mut candidates: Vec<&str> = Vec::new();
    let mut should_not_run: Vec<&Pod> = Vec::new();
    let node_of = |name: &str| view.nodes.iter().find(|n| n.metadata.name == name);
    for (node, pods) in &by_node {
        let Some((new, old)) = split(pods, view) else {
            surged += 1;
            continue;
        };
        if let Some(p) = old.or(new)
            && available(p, plan)
        {
            num_available += 1;
        }
        let runs_here = || node_of(node).is_some_and(|n| fit::should_run(&spec, n).0);
        match (new, old) {
            (_, None) => {}
            (None, Some(old)) => {
                if !available(old, plan) {
                    if runs_here() {
                        allowed.push(node);
                    } else {
                        delete(plan, old);
                    }
                } else if !runs_here() {
                    should_not_run.push(old);
                } else if surged < max_surge {
                    candidates.push(node);
                }
            }
            (Some(new), Some(old)) => {
                if available(new, plan) {
                    delete(plan, old);
                } else {
                    surged += 1;
                }
            }
        }
    }
    // With surge the owner expects full availability: a pod on a node it no longer
    // fits goes only once enough pods elsewhere are available.
    let deletable = (num_available - desired).clamp(0, should_not_run.len() as i64) as usize;
    for p in should_not_run.into_iter().take(deletable) {
        delete(plan, p);
    }
    let room = (max_surge - surged).clamp(0, candidates.len() as i64) as usize;
    plan.create_on.extend(
        allowed
            .into_iter()
            .chain(candidates.into_iter().take(room))
            .map(str::to_owned),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn unavailability_defaults_to_one_and_percentages_round_up() {
        let ds = |ru: Value| json!({"spec": {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": ru}}});
        assert_eq!(counts(&ds(json!({})), 10).unwrap(), (0, 1));
        assert_eq!(
            counts(&ds(json!({"maxUnavailable": "25%"})), 10).unwrap(),
            (0, 3)
        );
        assert_eq!(
            counts(&ds(json!({"maxUnavailable": 0, "maxSurge": "10%"})), 10).unwrap(),
            (1, 0)
        );
        assert_eq!(
            counts(&ds(json!({"maxUnavailable": 0, "maxSurge": 0})), 10).unwrap(),
            (0, 1)
        );
        assert!(counts(&ds(json!({"maxSurge": "x"})), 10).is_err());
    }
}
