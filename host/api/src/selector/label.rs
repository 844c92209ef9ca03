//! Label selectors and their requirements, as `k8s.io/apimachinery/pkg/labels`
//! (`selector.go`): building, matching, printing, and the structured
//! `metav1.LabelSelector` of Deployments, ReplicaSets and the like.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1 as metav1;

use super::validation::{validate_key, validate_value};
use super::{Result, SelectorError};

/// The operator of one label [`Requirement`], as in `k8s.io/apimachinery/pkg/selection`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LabelOp {
    /// `key=value`
    Equals,
    /// `key==value`; matches as [`LabelOp::Equals`], kept apart so the string prints back.
    DoubleEquals,
    /// `key!=value`; also matches when the key is absent.
    NotEquals,
    /// `key in (a,b)`
    In,
    /// `key notin (a,b)`; also matches when the key is absent.
    NotIn,
    /// `key`
    Exists,
    /// `!key`
    DoesNotExist,
    /// `key>N`, integers only.
    GreaterThan,
    /// `key<N`, integers only.
    LessThan,
}

impl LabelOp {
    /// The operator's name in `k8s.io/apimachinery/pkg/selection`.
    pub fn as_str(self) -> &'static str {
        match self {
            LabelOp::Equals => "=",
            LabelOp::DoubleEquals => "==",
            LabelOp::NotEquals => "!=",
            LabelOp::In => "in",
            LabelOp::NotIn => "notin",
            LabelOp::Exists => "exists",
            LabelOp::DoesNotExist => "!",
            LabelOp::GreaterThan => "gt",
            LabelOp::LessThan => "lt",
        }
    }
}

impl fmt::Display for LabelOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One condition on one label key; a [`LabelSelector`] is the AND of its requirements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    key: String,
    operator: LabelOp,
    /// Sorted and deduplicated: membership is a binary search, and printing is canonical.
    values: Vec<String>,
}

impl Requirement {
    /// Builds a requirement, validating the key, the values and their number the way
    /// `labels.NewRequirement` does.
    pub fn new<I, V>(key: impl Into<String>, operator: LabelOp, values: I) -> Result<Self>
    where
        I: IntoIterator<Item = V>,
        V: Into<String>,
    {
        let key = key.into();
        let mut values: Vec<String> = values.into_iter().map(Into::into).collect();
        validate_key(&key).map_err(|reason| SelectorError::InvalidKey {
            key: key.clone(),
            reason,
        })?;

        let count_error = |reason| SelectorError::ValueCount {
            key: key.clone(),
            reason,
            count: values.len(),
        };
        match operator {
            LabelOp::In | LabelOp::NotIn if values.is_empty() => {
                return Err(count_error(
                    "the 'in' and 'notin' operators need at least one value",
                ));
            }
            LabelOp::Equals | LabelOp::DoubleEquals | LabelOp::NotEquals if values.len() != 1 => {
                return Err(count_error(
                    "the '=', '==' and '!=' operators need exactly one value",
                ));
            }
            LabelOp::Exists | LabelOp::DoesNotExist if !values.is_empty() => {
                return Err(count_error(
                    "the 'exists' and 'does not exist' operators take no values",
                ));
            }
            LabelOp::GreaterThan | LabelOp::LessThan if values.len() != 1 => {
                return Err(count_error(
                    "the '>' and '<' operators need exactly one value",
                ));
            }
            _ => {}
        }

        for value in &values {
            let integer_needed = matches!(operator, LabelOp::GreaterThan | LabelOp::LessThan);
            let reason = if integer_needed && value.parse::<i64>().is_err() {
                Some("the '>' and '<' operators need an integer value")
            } else {
                validate_value(value).err()
            };
            if let Some(reason) = reason {
                return Err(SelectorError::InvalidValue {
                    key,
                    value: value.clone(),
                    reason,
                });
            }
        }

        values.sort();
        values.dedup();
        Ok(Requirement {
            key,
            operator,
            values,
        })
    }

    /// The label key this requirement is about.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The operator.
    pub fn operator(&self) -> LabelOp {
        self.operator
    }

    /// The values, sorted and without duplicates; empty for `Exists` and `DoesNotExist`.
    pub fn values(&self) -> &[String] {
        &self.values
    }

    /// Whether labels, read through `label`, satisfy this requirement.
    pub fn matches<'a>(&self, label: impl Fn(&str) -> Option<&'a str>) -> bool {
        let actual = label(&self.key);
        match self.operator {
            LabelOp::Equals | LabelOp::DoubleEquals | LabelOp::In => {
                actual.is_some_and(|v| self.has_value(v))
            }
            LabelOp::NotEquals | LabelOp::NotIn => actual.is_none_or(|v| !self.has_value(v)),
            LabelOp::Exists => actual.is_some(),
            LabelOp::DoesNotExist => actual.is_none(),
            LabelOp::GreaterThan | LabelOp::LessThan => {
                // A label that is absent or not an integer never matches, as in Kubernetes.
                let (Some(actual), [bound]) = (actual, self.values.as_slice()) else {
                    return false;
                };
                let (Ok(actual), Ok(bound)) = (actual.parse::<i64>(), bound.parse::<i64>()) else {
                    return false;
                };
                if self.operator == LabelOp::GreaterThan {
                    actual > bound
                } else {
                    actual < bound
                }
            }
        }
    }

    fn has_value(&self, value: &str) -> bool {
        self.values
            .binary_search_by(|v| v.as_str().cmp(value))
            .is_ok()
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (before, after) = match self.operator {
            LabelOp::DoesNotExist => return write!(f, "!{}", self.key),
            LabelOp::Exists => return f.write_str(&self.key),
            LabelOp::Equals => ("=", ""),
            LabelOp::DoubleEquals => ("==", ""),
            LabelOp::NotEquals => ("!=", ""),
            LabelOp::GreaterThan => (">", ""),
            LabelOp::LessThan => ("<", ""),
            LabelOp::In => (" in (", ")"),
            LabelOp::NotIn => (" notin (", ")"),
        };
        write!(f, "{}{before}{}{after}", self.key, self.values.join(","))
    }
}

/// A label selector: the AND of its [`Requirement`]s. The empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    /// Sorted by key (stably), as Kubernetes does, so printing is deterministic.
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    /// A selector from requirements, in any order.
    pub fn new(requirements: impl IntoIterator<Item = Requirement>) -> Self {
        let mut requirements: Vec<Requirement> = requirements.into_iter().collect();
        requirements.sort_by(|a, b| a.key.cmp(&b.key));
        LabelSelector { requirements }
    }

    /// Converts a `metav1.LabelSelector` (`matchLabels` and `matchExpressions`). An empty
    /// one selects everything, as for Deployments.
    pub fn from_k8s(sel: &metav1::LabelSelector) -> Result<Self> {
        let mut requirements = Vec::new();
        for (key, value) in sel.match_labels.iter().flatten() {
            requirements.push(Requirement::new(
                key.as_str(),
                LabelOp::Equals,
                [value.as_str()],
            )?);
        }
        for expr in sel.match_expressions.iter().flatten() {
            let operator = match expr.operator.as_str() {
                "In" => LabelOp::In,
                "NotIn" => LabelOp::NotIn,
                "Exists" => LabelOp::Exists,
                "DoesNotExist" => LabelOp::DoesNotExist,
                other => return Err(SelectorError::UnknownOperator(other.to_owned())),
            };
            let values = expr.values.iter().flatten().map(String::as_str);
            requirements.push(Requirement::new(expr.key.as_str(), operator, values)?);
        }
        Ok(Self::new(requirements))
    }

    /// The requirements, sorted by key.
    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    /// Whether this selector has no requirements and so matches everything.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    /// Whether labels, read through `label` (`None` = no such label), satisfy every requirement.
    pub fn matches<'a>(&self, label: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.requirements.iter().all(|r| r.matches(&label))
    }

    /// Whether a label map satisfies every requirement.
    pub fn matches_map(&self, labels: &BTreeMap<String, String>) -> bool {
        self.matches(|key| labels.get(key).map(String::as_str))
    }

    /// Whether a JSON object's `metadata.labels` satisfy every requirement; an object
    /// without labels has none, and a non-string label value counts as absent.
    pub fn matches_object(&self, obj: &serde_json::Value) -> bool {
        let labels = obj
            .pointer("/metadata/labels")
            .and_then(serde_json::Value::as_object);
        self.matches(|key| {
            labels
                .and_then(|labels| labels.get(key))
                .and_then(serde_json::Value::as_str)
        })
    }

    /// The value `key` must equal for this selector to match, if a requirement pins it
    /// (`=`, `==`, or `in` with a single value), like `RequiresExactMatch` in Kubernetes.
    pub fn requires_exact_match(&self, key: &str) -> Option<&str> {
        self.requirements
            .iter()
            .find_map(|r| match (r.operator, r.values.as_slice()) {
                (LabelOp::Equals | LabelOp::DoubleEquals | LabelOp::In, [value])
                    if r.key == key =>
                {
                    Some(value.as_str())
                }
                _ => None,
            })
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, requirement) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{requirement}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::test_support::{labels, parse, parse_err};
    use serde_json::json;

    #[test]
    fn greater_and_less_than_need_integers() {
        let err = parse_err("a>b");
        assert!(
            err.contains("invalid label value \"b\" for key \"a\""),
            "{err}"
        );
        assert!(err.contains("integer"), "{err}");
        let err = parse_err("a<");
        assert!(err.contains("integer"), "{err}");
        // An integer that is not a valid label value is still refused, as in Kubernetes.
        let err = parse_err("a>-1");
        assert!(
            err.contains("must start and end with an alphanumeric"),
            "{err}"
        );
    }

    // --- label selector matching ---

    #[test]
    fn equals_matches_only_the_same_value() {
        for input in ["a=b", "a==b", "a in (b)"] {
            let sel = parse(input);
            assert!(sel.matches_map(&labels(&[("a", "b")])), "{input}");
            assert!(!sel.matches_map(&labels(&[("a", "c")])), "{input}");
            assert!(!sel.matches_map(&labels(&[])), "{input}");
        }
    }

    #[test]
    fn not_equals_and_notin_match_absent_keys() {
        for input in ["a!=b", "a notin (b,c)"] {
            let sel = parse(input);
            assert!(sel.matches_map(&labels(&[])), "{input}");
            assert!(sel.matches_map(&labels(&[("a", "x")])), "{input}");
            assert!(!sel.matches_map(&labels(&[("a", "b")])), "{input}");
        }
    }

    #[test]
    fn in_matches_any_listed_value() {
        let sel = parse("a in (x,y)");
        assert!(sel.matches_map(&labels(&[("a", "x")])));
        assert!(sel.matches_map(&labels(&[("a", "y")])));
        assert!(!sel.matches_map(&labels(&[("a", "z")])));
        assert!(!sel.matches_map(&labels(&[("b", "x")])));
    }

    #[test]
    fn exists_and_does_not_exist_look_only_at_the_key() {
        let exists = parse("a");
        let absent = parse("!a");
        let with_empty = labels(&[("a", "")]);
        assert!(exists.matches_map(&with_empty));
        assert!(!absent.matches_map(&with_empty));
        assert!(!exists.matches_map(&labels(&[("b", "")])));
        assert!(absent.matches_map(&labels(&[("b", "")])));
    }

    #[test]
    fn greater_and_less_than_compare_integers() {
        let gt = parse("n>5");
        let lt = parse("n<5");
        assert!(gt.matches_map(&labels(&[("n", "10")])));
        assert!(!gt.matches_map(&labels(&[("n", "5")])));
        assert!(!lt.matches_map(&labels(&[("n", "5")])));
        assert!(lt.matches_map(&labels(&[("n", "4")])));
        // Numeric, not lexical: "10" > "5".
        assert!(!lt.matches_map(&labels(&[("n", "10")])));
        // Absent or non-integer labels never match either way.
        for set in [labels(&[]), labels(&[("n", "x")])] {
            assert!(!gt.matches_map(&set));
            assert!(!lt.matches_map(&set));
        }
    }

    #[test]
    fn all_requirements_must_match() {
        let sel = parse("a=1,b");
        assert!(sel.matches_map(&labels(&[("a", "1"), ("b", "2")])));
        assert!(!sel.matches_map(&labels(&[("a", "1")])));
        assert!(!sel.matches_map(&labels(&[("a", "2"), ("b", "2")])));
    }

    #[test]
    fn matches_reads_labels_through_the_closure() {
        let sel = parse("a=1");
        assert!(sel.matches(|k| (k == "a").then_some("1")));
        assert!(!sel.matches(|_| None));
    }

    #[test]
    fn matches_object_reads_metadata_labels() {
        let sel = parse("app=web,!canary");
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "web"}}});
        assert!(sel.matches_object(&pod));
        let canary = json!({"metadata": {"labels": {"app": "web", "canary": "true"}}});
        assert!(!sel.matches_object(&canary));
        let unlabelled = json!({"metadata": {"name": "p"}});
        assert!(!sel.matches_object(&unlabelled));
        assert!(parse("!app").matches_object(&unlabelled));
        assert!(parse("app!=web").matches_object(&json!({})));
        assert!(parse("").matches_object(&json!("not an object")));
        // A non-string label value counts as absent.
        assert!(!parse("n").matches_object(&json!({"metadata": {"labels": {"n": 1}}})));
    }

    #[test]
    fn requires_exact_match_finds_pinned_keys() {
        let sel = parse("a=1,b in (2),c in (3,4),d!=5");
        assert_eq!(sel.requires_exact_match("a"), Some("1"));
        assert_eq!(sel.requires_exact_match("b"), Some("2"));
        assert_eq!(sel.requires_exact_match("c"), None);
        assert_eq!(sel.requires_exact_match("d"), None);
        assert_eq!(sel.requires_exact_match("e"), None);
    }

    // --- label selector printing ---

    #[test]
    fn display_round_trips() {
        let cases = [
            ("a=b", "a=b"),
            ("a==b", "a==b"),
            ("a != b", "a!=b"),
            ("a in (y, x)", "a in (x,y)"),
            ("a notin (x)", "a notin (x)"),
            ("a", "a"),
            ("! a", "!a"),
            ("a>1", "a>1"),
            ("a < 1", "a<1"),
            ("a=", "a="),
            ("a in ()", "a in ()"),
            ("a in (,x)", "a in (,x)"),
            ("z,y=1,x in (b,a)", "x in (a,b),y=1,z"),
        ];
        for (input, canonical) in cases {
            let sel = parse(input);
            assert_eq!(sel.to_string(), canonical, "{input}");
            assert_eq!(parse(canonical), sel, "{input}");
        }
    }

    // --- metav1.LabelSelector ---

    fn expr(key: &str, op: &str, values: Option<&[&str]>) -> metav1::LabelSelectorRequirement {
        metav1::LabelSelectorRequirement {
            key: key.to_owned(),
            operator: op.to_owned(),
            values: values.map(|v| v.iter().map(|s| (*s).to_owned()).collect()),
        }
    }

    fn k8s(
        match_labels: &[(&str, &str)],
        exprs: Vec<metav1::LabelSelectorRequirement>,
    ) -> metav1::LabelSelector {
        metav1::LabelSelector {
            match_labels: (!match_labels.is_empty()).then(|| labels(match_labels)),
            match_expressions: (!exprs.is_empty()).then_some(exprs),
        }
    }

    #[test]
    fn empty_k8s_selector_matches_everything() {
        let sel = LabelSelector::from_k8s(&metav1::LabelSelector::default()).unwrap();
        assert!(sel.is_empty());
        assert!(sel.matches_map(&labels(&[("a", "b")])));
        let sel = LabelSelector::from_k8s(&metav1::LabelSelector {
            match_labels: Some(BTreeMap::new()),
            match_expressions: Some(Vec::new()),
        })
        .unwrap();
        assert!(sel.is_empty());
    }

    #[test]
    fn from_k8s_converts_every_operator() {
        let sel = LabelSelector::from_k8s(&k8s(
            &[("app", "web")],
            vec![
                expr("tier", "In", Some(&["fe", "be"])),
                expr("env", "NotIn", Some(&["prod"])),
                expr("team", "Exists", None),
                expr("canary", "DoesNotExist", Some(&[])),
            ],
        ))
        .unwrap();
        assert_eq!(
            sel.to_string(),
            "app=web,!canary,env notin (prod),team,tier in (be,fe)"
        );
        assert!(sel.matches_map(&labels(&[("app", "web"), ("tier", "fe"), ("team", "x")])));
        assert!(!sel.matches_map(&labels(&[("app", "web"), ("tier", "fe")])));
        assert!(!sel.matches_map(&labels(&[
            ("app", "web"),
            ("tier", "fe"),
            ("team", "x"),
            ("env", "prod"),
        ])));
        assert!(!sel.matches_map(&labels(&[
            ("app", "web"),
            ("tier", "fe"),
            ("team", "x"),
            ("canary", "1"),
        ])));
    }

    #[test]
    fn from_k8s_rejects_unknown_operators() {
        let err =
            LabelSelector::from_k8s(&k8s(&[], vec![expr("a", "Gt", Some(&["1"]))])).unwrap_err();
        assert_eq!(err, SelectorError::UnknownOperator("Gt".to_owned()));
        assert!(
            err.to_string()
                .contains("\"Gt\" is not a valid label selector operator")
        );
        // Operators are case-sensitive.
        let err =
            LabelSelector::from_k8s(&k8s(&[], vec![expr("a", "in", Some(&["1"]))])).unwrap_err();
        assert_eq!(err, SelectorError::UnknownOperator("in".to_owned()));
    }

    #[test]
    fn from_k8s_checks_value_counts() {
        for op in ["In", "NotIn"] {
            for values in [None, Some(&[][..])] {
                let err =
                    LabelSelector::from_k8s(&k8s(&[], vec![expr("a", op, values)])).unwrap_err();
                assert!(
                    matches!(err, SelectorError::ValueCount { count: 0, .. }),
                    "{op}: {err:?}"
                );
                assert!(err.to_string().contains("at least one value"), "{err}");
            }
        }
        for op in ["Exists", "DoesNotExist"] {
            let err =
                LabelSelector::from_k8s(&k8s(&[], vec![expr("a", op, Some(&["x"]))])).unwrap_err();
            assert!(
                err.to_string().contains("take no values, got 1"),
                "{op}: {err}"
            );
        }
    }

    #[test]
    fn from_k8s_validates_keys_and_values() {
        let err = LabelSelector::from_k8s(&k8s(&[("bad key", "x")], vec![])).unwrap_err();
        assert!(matches!(err, SelectorError::InvalidKey { ref key, .. } if key == "bad key"));
        let err = LabelSelector::from_k8s(&k8s(&[("a", "bad value")], vec![])).unwrap_err();
        assert!(
            matches!(err, SelectorError::InvalidValue { ref value, .. } if value == "bad value")
        );
        let err = LabelSelector::from_k8s(&k8s(&[], vec![expr("a", "In", Some(&["ok", "-no"]))]))
            .unwrap_err();
        assert!(err.to_string().contains("\"-no\""), "{err}");
        let err = LabelSelector::from_k8s(&k8s(&[], vec![expr("", "Exists", None)])).unwrap_err();
        assert!(
            err.to_string().contains("name part must be non-empty"),
            "{err}"
        );
    }

    #[test]
    fn requirement_new_checks_counts_for_exact_operators() {
        let err = Requirement::new("a", LabelOp::Equals, ["x", "y"]).unwrap_err();
        assert!(
            err.to_string().contains("exactly one value, got 2"),
            "{err}"
        );
        let err = Requirement::new("a", LabelOp::GreaterThan, None::<&str>).unwrap_err();
        assert!(
            err.to_string().contains("exactly one value, got 0"),
            "{err}"
        );
    }
}
