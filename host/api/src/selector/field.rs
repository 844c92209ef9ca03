//! Field selectors (`?fieldSelector=`), as `k8s.io/apimachinery/pkg/fields`:
//! parsing with escapes, matching and printing.

use std::fmt;
use std::str::FromStr;

use super::{Result, SelectorError};

/// The operator of one field requirement. `==` parses as [`FieldOp::Equals`], as in Kubernetes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FieldOp {
    /// `field=value` or `field==value`
    Equals,
    /// `field!=value`
    NotEquals,
}

impl fmt::Display for FieldOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FieldOp::Equals => "=",
            FieldOp::NotEquals => "!=",
        })
    }
}

/// One `field=value` or `field!=value` term of a [`FieldSelector`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldRequirement {
    field: String,
    operator: FieldOp,
    /// Unescaped.
    value: String,
}

impl FieldRequirement {
    /// A requirement; `value` is the literal value, not escaped.
    pub fn new(field: impl Into<String>, operator: FieldOp, value: impl Into<String>) -> Self {
        FieldRequirement {
            field: field.into(),
            operator,
            value: value.into(),
        }
    }

    /// The field path, e.g. `spec.nodeName`.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The operator.
    pub fn operator(&self) -> FieldOp {
        self.operator
    }

    /// The literal (unescaped) value.
    pub fn value(&self) -> &str {
        &self.value
    }

    /// Whether the field's value satisfies this requirement; an absent field is the
    /// empty string, as in Kubernetes' field sets.
    pub fn matches(&self, actual: Option<&str>) -> bool {
        let equal = actual.unwrap_or("") == self.value;
        match self.operator {
            FieldOp::Equals => equal,
            FieldOp::NotEquals => !equal,
        }
    }
}

impl fmt::Display for FieldRequirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}{}",
            self.field,
            self.operator,
            escape_field_value(&self.value)
        )
    }
}

/// A field selector: the AND of its [`FieldRequirement`]s. The empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    /// Sorted by printed form, which is Kubernetes' order (it sorts the raw terms) except
    /// that `==` prints as `=`; sorting the printed form keeps printing idempotent.
    requirements: Vec<FieldRequirement>,
}

impl FieldSelector {
    /// A selector from requirements, in any order.
    pub fn new(requirements: impl IntoIterator<Item = FieldRequirement>) -> Self {
        let mut requirements: Vec<FieldRequirement> = requirements.into_iter().collect();
        requirements.sort_by_cached_key(ToString::to_string);
        FieldSelector { requirements }
    }

    /// Parses the string form of `?fieldSelector=`: comma-separated `field=value`,
    /// `field==value` or `field!=value`. In values, `\,`, `\=` and `\\` stand for `,`, `=`
    /// and `\`. Whitespace is not trimmed (Kubernetes does not either), and empty terms
    /// are skipped, so the empty string selects everything.
    pub fn parse(s: &str) -> Result<Self> {
        let mut requirements = Vec::new();
        for term in split_terms(s) {
            if term.is_empty() {
                continue;
            }
            let (field, operator, raw_value) =
                split_term(term).ok_or_else(|| SelectorError::FieldTerm {
                    selector: s.to_owned(),
                    term: term.to_owned(),
                })?;
            let value = unescape_field_value(raw_value, term)?;
            requirements.push(FieldRequirement::new(field, operator, value));
        }
        Ok(Self::new(requirements))
    }

    /// The requirements, in printing order.
    pub fn requirements(&self) -> &[FieldRequirement] {
        &self.requirements
    }

    /// The field paths this selector reads, once per requirement, so a server can refuse
    /// those its resource does not support.
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.requirements.iter().map(FieldRequirement::field)
    }

    /// The first requirement on `field`, if any.
    pub fn requirement_for(&self, field: &str) -> Option<(&FieldOp, &str)> {
        self.requirements
            .iter()
            .find(|r| r.field == field)
            .map(|r| (&r.operator, r.value.as_str()))
    }

    /// The value `field` must equal for this selector to match, if a requirement pins it,
    /// like `RequiresExactMatch` in Kubernetes; a server can use it to narrow a scan
    /// (e.g. `spec.nodeName=node-1`).
    pub fn exact_match(&self, field: &str) -> Option<&str> {
        self.requirements
            .iter()
            .find(|r| r.field == field && r.operator == FieldOp::Equals)
            .map(FieldRequirement::value)
    }

    /// Whether this selector has no requirements and so matches everything.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    /// Whether the fields, read through `field` (`None` = absent, which compares as the
    /// empty string), satisfy every requirement.
    pub fn matches(&self, field: impl Fn(&str) -> Option<String>) -> bool {
        self.requirements
            .iter()
            .all(|r| r.matches(field(&r.field).as_deref()))
    }
}

impl fmt::Display for FieldSelector {
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

impl FromStr for FieldSelector {
    type Err = SelectorError;

    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

/// Escapes a literal value for a field selector string: `\` → `\\`, `,` → `\,`, `=` → `\=`.
pub fn escape_field_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        if matches!(c, '\\' | ',' | '=') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// Splits on commas that are not escaped; escapes stay in the terms for
/// [`unescape_field_value`] to resolve.
fn split_terms(s: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    if s.is_empty() {
        return terms;
    }
    let mut start = 0;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == ',' {
            terms.push(&s[start..i]);
            start = i + 1;
        }
    }
    terms.push(&s[start..]);
    terms
}

/// Splits a term at the first operator; field names have no escapes, so the first `!=`,
/// `==` or `=` wins, `!=` and `==` before `=` so no `=` is left on the value.
fn split_term(term: &str) -> Option<(&str, FieldOp, &str)> {
    term.char_indices().find_map(|(i, _)| {
        let rest = &term[i..];
        let (operator, len) = if rest.starts_with("!=") {
            (FieldOp::NotEquals, 2)
        } else if rest.starts_with("==") {
            (FieldOp::Equals, 2)
        } else if rest.starts_with('=') {
            (FieldOp::Equals, 1)
        } else {
            return None;
        };
        Some((&term[..i], operator, &term[i + len..]))
    })
}

fn unescape_field_value(raw: &str, term: &str) -> Result<String> {
    let mut value = String::with_capacity(raw.len());
    let mut escaped = false;
    for c in raw.chars() {
        if escaped {
            if !matches!(c, '\\' | ',' | '=') {
                return Err(SelectorError::FieldEscape {
                    term: term.to_owned(),
                    sequence: format!("\\{c}"),
                });
            }
            value.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if matches!(c, ',' | '=') {
            return Err(SelectorError::FieldUnescaped {
                term: term.to_owned(),
                character: c,
            });
        } else {
            value.push(c);
        }
    }
    if escaped {
        return Err(SelectorError::FieldEscape {
            term: term.to_owned(),
            sequence: "\\".to_owned(),
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_parse(s: &str) -> FieldSelector {
        FieldSelector::parse(s).unwrap_or_else(|e| panic!("parse {s:?}: {e}"))
    }

    fn field_err(s: &str) -> String {
        match FieldSelector::parse(s) {
            Ok(sel) => panic!("{s:?} parsed as {sel:?}, expected an error"),
            Err(e) => e.to_string(),
        }
    }

    fn fields_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn field_selector_parses_every_operator() {
        let sel = field_parse("metadata.name=a,spec.nodeName==n1,status.phase!=Running");
        let reqs: Vec<(&str, FieldOp, &str)> = sel
            .requirements()
            .iter()
            .map(|r| (r.field(), r.operator(), r.value()))
            .collect();
        assert_eq!(
            reqs,
            [
                ("metadata.name", FieldOp::Equals, "a"),
                ("spec.nodeName", FieldOp::Equals, "n1"),
                ("status.phase", FieldOp::NotEquals, "Running"),
            ]
        );
        assert_eq!(
            sel.to_string(),
            "metadata.name=a,spec.nodeName=n1,status.phase!=Running"
        );
    }

    #[test]
    fn empty_field_selector_matches_everything() {
        for input in ["", ",", ",,"] {
            let sel = field_parse(input);
            assert!(sel.is_empty(), "{input:?}");
            assert!(sel.matches(|_| None));
            assert_eq!(sel.to_string(), "");
        }
    }

    #[test]
    fn field_selector_skips_empty_terms() {
        let sel = field_parse(",a=b,,");
        assert_eq!(sel.to_string(), "a=b");
    }

    #[test]
    fn field_selector_unescapes_values() {
        let sel = field_parse(r"a=x\,y,b=p\=q,c=back\\slash");
        assert_eq!(sel.requirement_for("a"), Some((&FieldOp::Equals, "x,y")));
        assert_eq!(sel.requirement_for("b"), Some((&FieldOp::Equals, "p=q")));
        assert_eq!(
            sel.requirement_for("c"),
            Some((&FieldOp::Equals, r"back\slash"))
        );
        assert_eq!(sel.to_string(), r"a=x\,y,b=p\=q,c=back\\slash");
    }

    #[test]
    fn escaped_backslash_before_comma_still_splits() {
        let sel = field_parse(r"a=x\\,b=y");
        assert_eq!(sel.exact_match("a"), Some(r"x\"));
        assert_eq!(sel.exact_match("b"), Some("y"));
    }

    #[test]
    fn field_selector_rejects_bad_escapes() {
        let err = field_err(r"a=x\y");
        assert!(err.contains(r#"invalid escape sequence "\y""#), "{err}");
        assert!(err.contains(r#"term "a=x\y""#), "{err}");
        let err = field_err(r"a=x\");
        assert!(err.contains(r#"invalid escape sequence "\""#), "{err}");
        let err = field_err("a=x=y");
        assert!(
            err.contains(r"unescaped '=' in value; write it as '\='"),
            "{err}"
        );
        let err = field_err("a!==x");
        assert!(err.contains("unescaped '='"), "{err}");
    }

    #[test]
    fn field_selector_rejects_terms_without_operator() {
        let err = field_err("a=b,oops");
        assert_eq!(
            err,
            "invalid field selector \"a=b,oops\": can't understand \"oops\"; expected field=value, field==value or field!=value"
        );
        assert!(field_err("a<b").contains("can't understand \"a<b\""));
    }

    #[test]
    fn field_selector_does_not_trim_whitespace() {
        let sel = field_parse("a = b");
        assert_eq!(sel.fields().collect::<Vec<_>>(), ["a "]);
        assert_eq!(sel.exact_match("a "), Some(" b"));
        assert_eq!(sel.exact_match("a"), None);
    }

    #[test]
    fn field_selector_treats_absent_fields_as_empty() {
        assert!(field_parse("a=").matches(|_| None));
        assert!(!field_parse("a!=").matches(|_| None));
        assert!(field_parse("a!=x").matches(|_| None));
        assert!(!field_parse("a=x").matches(|_| None));
    }

    #[test]
    fn field_selector_requires_every_term() {
        let sel = field_parse("spec.nodeName=n1,status.phase!=Failed");
        assert!(sel.matches(fields_of(&[
            ("spec.nodeName", "n1"),
            ("status.phase", "Running")
        ])));
        assert!(!sel.matches(fields_of(&[
            ("spec.nodeName", "n1"),
            ("status.phase", "Failed")
        ])));
        assert!(!sel.matches(fields_of(&[("spec.nodeName", "n2")])));
    }

    #[test]
    fn field_selector_lists_fields_for_the_server_to_check() {
        let sel = field_parse("spec.nodeName=n1,metadata.name!=x,spec.nodeName!=n2");
        let mut fields: Vec<&str> = sel.fields().collect();
        fields.sort_unstable();
        assert_eq!(fields, ["metadata.name", "spec.nodeName", "spec.nodeName"]);
    }

    #[test]
    fn exact_match_skips_not_equals_terms() {
        let sel = field_parse("spec.nodeName!=a,spec.nodeName=b");
        assert_eq!(
            sel.requirement_for("spec.nodeName"),
            Some((&FieldOp::NotEquals, "a"))
        );
        assert_eq!(sel.exact_match("spec.nodeName"), Some("b"));
        assert_eq!(sel.exact_match("metadata.name"), None);
        assert_eq!(sel.requirement_for("metadata.name"), None);
    }

    #[test]
    fn field_selector_display_is_idempotent() {
        for input in ["b==x,a=y", "a==x,a=b", r"f=\,\=\\", "z!=1,y=2"] {
            let printed = field_parse(input).to_string();
            let reparsed = field_parse(&printed);
            assert_eq!(reparsed, field_parse(input), "{input}");
            assert_eq!(reparsed.to_string(), printed, "{input}");
        }
        assert_eq!(field_parse("b==x,a=y").to_string(), "a=y,b=x");
    }

    #[test]
    fn escape_field_value_escapes_the_three_specials() {
        assert_eq!(escape_field_value(r"a,b=c\d"), r"a\,b\=c\\d");
        assert_eq!(escape_field_value("plain"), "plain");
    }

    #[test]
    fn field_requirements_built_by_hand_print_escaped() {
        let sel = FieldSelector::new([
            FieldRequirement::new("metadata.name", FieldOp::Equals, "a,b"),
            FieldRequirement::new("spec.nodeName", FieldOp::NotEquals, ""),
        ]);
        assert_eq!(sel.to_string(), r"metadata.name=a\,b,spec.nodeName!=");
        assert_eq!(
            "metadata.name=a\\,b,spec.nodeName!="
                .parse::<FieldSelector>()
                .unwrap(),
            sel
        );
    }
}
