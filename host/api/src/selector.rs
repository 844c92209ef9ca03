//! Label and field selectors: parsing, validation, matching and printing.
//!
//! This module owns the two selector languages a Kubernetes client speaks to the API
//! server, with the semantics of `k8s.io/apimachinery/pkg/labels` and `pkg/fields`:
//!
//! - [`LabelSelector`]: the `?labelSelector=` string form (`app=web,tier in (a,b),!canary`)
//!   and the structured `metav1.LabelSelector` of Deployments, ReplicaSets and the like
//!   ([`LabelSelector::from_k8s`]). Matching reads labels through a closure so callers
//!   can match maps, JSON objects or anything else without copying.
//! - [`FieldSelector`]: the `?fieldSelector=` string form (`spec.nodeName=node-1`). Which
//!   fields a resource supports is the server's business; [`FieldSelector::fields`] lets it
//!   refuse the rest, and [`FieldSelector::exact_match`] lets it narrow a scan.
//!
//! Both print back to their canonical string form through [`std::fmt::Display`].

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1 as metav1;

/// Why a selector could not be parsed or built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// The label selector string does not follow the grammar.
    #[error(
        "unable to parse label selector: at position {position}: found {}, expected: {expected}",
        describe_found(.found)
    )]
    Syntax {
        /// Byte offset of the offending token in the selector string.
        position: usize,
        /// The offending token; `None` at the end of the string.
        found: Option<String>,
        /// What the grammar allows here.
        expected: &'static str,
    },

    /// A label key is not a qualified name (`[prefix/]name`).
    #[error("invalid label key \"{key}\": {reason}")]
    InvalidKey { key: String, reason: &'static str },

    /// A label value is not valid for its key.
    #[error("invalid label value \"{value}\" for key \"{key}\": {reason}")]
    InvalidValue {
        key: String,
        value: String,
        reason: &'static str,
    },

    /// An operator got the wrong number of values.
    #[error("invalid requirement on label key \"{key}\": {reason}, got {count}")]
    ValueCount {
        key: String,
        reason: &'static str,
        count: usize,
    },

    /// A `matchExpressions` entry names an operator Kubernetes does not know.
    #[error(
        "\"{0}\" is not a valid label selector operator; expected In, NotIn, Exists or DoesNotExist"
    )]
    UnknownOperator(String),

    /// A field selector term has no `=`, `==` or `!=`.
    #[error(
        "invalid field selector \"{selector}\": can't understand \"{term}\"; expected field=value, field==value or field!=value"
    )]
    FieldTerm { selector: String, term: String },

    /// A field selector value contains a backslash that escapes nothing escapable.
    #[error(
        "invalid field selector term \"{term}\": invalid escape sequence \"{sequence}\"; only \\\\, \\, and \\= are allowed"
    )]
    FieldEscape { term: String, sequence: String },

    /// A field selector value contains a bare `,` or `=`, which must be escaped.
    #[error(
        "invalid field selector term \"{term}\": unescaped '{character}' in value; write it as '\\{character}'"
    )]
    FieldUnescaped { term: String, character: char },
}

/// Result of selector operations.
pub type Result<T, E = SelectorError> = std::result::Result<T, E>;

fn describe_found(found: &Option<String>) -> String {
    match found {
        Some(token) => format!("'{token}'"),
        None => "end of string".to_owned(),
    }
}

// ---------------------------------------------------------------------------
// Label selectors
// ---------------------------------------------------------------------------

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

    /// Parses the string form of `?labelSelector=`. The empty string selects everything.
    pub fn parse(s: &str) -> Result<Self> {
        Parser::new(s).parse().map(Self::new)
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

impl FromStr for LabelSelector {
    type Err = SelectorError;

    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

const QUALIFIED_NAME_CHARS: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

/// Validates a label key (or another qualified name, such as a finalizer) as
/// Kubernetes' `IsQualifiedName`: `[prefix/]name`, where the prefix is a DNS-1123
/// subdomain and the name at most 63 characters.
pub fn validate_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if name.contains('/') {
        return Err(
            "a key is a name with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName'), with at most one '/'",
        );
    }
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Err("prefix part must be non-empty");
        }
        if prefix.len() > 253 {
            return Err("prefix part must be no more than 253 characters");
        }
        if !is_dns1123_subdomain(prefix) {
            return Err(
                "prefix part must be a lowercase RFC 1123 subdomain: lower case alphanumeric characters, '-' or '.', starting and ending with an alphanumeric character",
            );
        }
    }
    if name.is_empty() {
        return Err("name part must be non-empty");
    }
    if name.len() > 63 {
        return Err("name part must be no more than 63 characters");
    }
    if !is_qualified_name_part(name) {
        return Err(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
        );
    }
    Ok(())
}

/// Validates a label value as Kubernetes' `IsValidLabelValue`; the empty value is valid.
fn validate_value(value: &str) -> Result<(), &'static str> {
    if value.len() > 63 {
        return Err("must be no more than 63 characters");
    }
    if !value.is_empty() && !is_qualified_name_part(value) {
        return Err(QUALIFIED_NAME_CHARS);
    }
    Ok(())
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn is_qualified_name_part(s: &str) -> bool {
    let bytes = s.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// Dot-separated labels of `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn is_dns1123_subdomain(s: &str) -> bool {
    s.split('.').all(|label| {
        let bytes = label.as_bytes();
        let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        match (bytes.first(), bytes.last()) {
            (Some(first), Some(last)) => {
                alnum(first) && alnum(last) && bytes.iter().all(|b| alnum(b) || *b == b'-')
            }
            _ => false,
        }
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenKind {
    Identifier,
    /// The keyword `in`; an identifier everywhere but in operator position.
    In,
    /// The keyword `notin`; an identifier everywhere but in operator position.
    NotIn,
    Bang,
    Equals,
    DoubleEquals,
    NotEquals,
    GreaterThan,
    LessThan,
    OpenParen,
    CloseParen,
    Comma,
    End,
}

#[derive(Debug, Clone, Copy)]
struct Token<'s> {
    kind: TokenKind,
    text: &'s str,
    offset: usize,
}

/// The whitespace Kubernetes' lexer skips; anything else non-special is part of an identifier.
fn is_whitespace(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

fn special_kind(c: char) -> Option<TokenKind> {
    Some(match c {
        '!' => TokenKind::Bang,
        '=' => TokenKind::Equals,
        '>' => TokenKind::GreaterThan,
        '<' => TokenKind::LessThan,
        '(' => TokenKind::OpenParen,
        ')' => TokenKind::CloseParen,
        ',' => TokenKind::Comma,
        _ => return None,
    })
}

fn tokenize(s: &str) -> Vec<Token<'_>> {
    let mut tokens = Vec::new();
    let mut chars = s.char_indices().peekable();
    while let Some(&(start, c)) = chars.peek() {
        if is_whitespace(c) {
            chars.next();
            continue;
        }
        let kind = if let Some(kind) = special_kind(c) {
            chars.next();
            // Longest match: `!=` and `==` are the only two-character symbols.
            match (kind, chars.peek()) {
                (TokenKind::Bang, Some((_, '='))) => {
                    chars.next();
                    TokenKind::NotEquals
                }
                (TokenKind::Equals, Some((_, '='))) => {
                    chars.next();
                    TokenKind::DoubleEquals
                }
                _ => kind,
            }
        } else {
            while chars
                .peek()
                .is_some_and(|&(_, c)| !is_whitespace(c) && special_kind(c).is_none())
            {
                chars.next();
            }
            TokenKind::Identifier
        };
        let end = chars.peek().map_or(s.len(), |&(i, _)| i);
        let text = &s[start..end];
        let kind = match (kind, text) {
            (TokenKind::Identifier, "in") => TokenKind::In,
            (TokenKind::Identifier, "notin") => TokenKind::NotIn,
            _ => kind,
        };
        tokens.push(Token {
            kind,
            text,
            offset: start,
        });
    }
    tokens
}

/// A recursive-descent parser over the tokens of a label selector string, following
/// the grammar of `k8s.io/apimachinery/pkg/labels`:
///
/// ```text
/// selector    ::= "" | requirement ("," requirement)*
/// requirement ::= "!" KEY | KEY [ ("="|"=="|"!="|">"|"<") [VALUE] | ("in"|"notin") "(" values ")" ]
/// values      ::= "" | VALUE-or-empty ("," VALUE-or-empty)*
/// ```
struct Parser<'s> {
    tokens: Vec<Token<'s>>,
    position: usize,
    end: Token<'s>,
}

impl<'s> Parser<'s> {
    fn new(s: &'s str) -> Self {
        Parser {
            tokens: tokenize(s),
            position: 0,
            end: Token {
                kind: TokenKind::End,
                text: "",
                offset: s.len(),
            },
        }
    }

    /// The next token, with keywords read as identifiers (the "values" context).
    fn peek(&self) -> Token<'s> {
        let mut token = self.peek_raw();
        if matches!(token.kind, TokenKind::In | TokenKind::NotIn) {
            token.kind = TokenKind::Identifier;
        }
        token
    }

    fn peek_raw(&self) -> Token<'s> {
        self.tokens.get(self.position).copied().unwrap_or(self.end)
    }

    fn next(&mut self) -> Token<'s> {
        let token = self.peek();
        self.position += 1;
        token
    }

    fn next_raw(&mut self) -> Token<'s> {
        let token = self.peek_raw();
        self.position += 1;
        token
    }

    fn parse(mut self) -> Result<Vec<Requirement>> {
        let mut requirements = Vec::new();
        loop {
            let token = self.peek();
            match token.kind {
                TokenKind::End => return Ok(requirements),
                TokenKind::Identifier | TokenKind::Bang => {}
                _ => return Err(syntax(token, "'!', identifier, or end of string")),
            }
            requirements.push(self.parse_requirement()?);
            let token = self.next();
            match token.kind {
                TokenKind::End => return Ok(requirements),
                TokenKind::Comma => {
                    let after = self.peek();
                    if !matches!(after.kind, TokenKind::Identifier | TokenKind::Bang) {
                        return Err(syntax(after, "'!' or identifier after ','"));
                    }
                }
                _ => return Err(syntax(token, "',' or end of string")),
            }
        }
    }

    fn parse_requirement(&mut self) -> Result<Requirement> {
        let mut token = self.next();
        let does_not_exist = token.kind == TokenKind::Bang;
        if does_not_exist {
            token = self.next();
        }
        if token.kind != TokenKind::Identifier {
            return Err(syntax(token, "identifier"));
        }
        let key = token.text;
        // Validate before looking further, so a bad key is reported as such rather than
        // as whatever syntax error follows it.
        validate_key(key).map_err(|reason| SelectorError::InvalidKey {
            key: key.to_owned(),
            reason,
        })?;
        if does_not_exist {
            // Anything after `!key` is left for the caller, which wants `,` or the end.
            return Requirement::new(key, LabelOp::DoesNotExist, None::<&str>);
        }
        if matches!(self.peek().kind, TokenKind::End | TokenKind::Comma) {
            return Requirement::new(key, LabelOp::Exists, None::<&str>);
        }

        let token = self.next_raw();
        let operator = match token.kind {
            TokenKind::Equals => LabelOp::Equals,
            TokenKind::DoubleEquals => LabelOp::DoubleEquals,
            TokenKind::NotEquals => LabelOp::NotEquals,
            TokenKind::GreaterThan => LabelOp::GreaterThan,
            TokenKind::LessThan => LabelOp::LessThan,
            TokenKind::In => LabelOp::In,
            TokenKind::NotIn => LabelOp::NotIn,
            _ => return Err(syntax(token, "one of =, ==, !=, in, notin, >, <")),
        };
        let values = match operator {
            LabelOp::In | LabelOp::NotIn => self.parse_value_set()?,
            _ => vec![self.parse_exact_value()?],
        };
        Requirement::new(key, operator, values)
    }

    /// `(a,b)`; an empty slot (`()`, `(,a)`, `(a,,b)`, `(a,)`) is the empty value.
    fn parse_value_set(&mut self) -> Result<Vec<&'s str>> {
        let token = self.next();
        if token.kind != TokenKind::OpenParen {
            return Err(syntax(token, "'('"));
        }
        let mut values = Vec::new();
        // Whether the slot before the next separator already holds a value.
        let mut filled = false;
        loop {
            let token = self.next();
            match token.kind {
                TokenKind::Identifier if !filled => {
                    values.push(token.text);
                    filled = true;
                }
                TokenKind::Identifier => return Err(syntax(token, "',' or ')'")),
                TokenKind::Comma => {
                    if !filled {
                        values.push("");
                    }
                    filled = false;
                }
                TokenKind::CloseParen => {
                    if !filled {
                        values.push("");
                    }
                    return Ok(values);
                }
                _ if filled => return Err(syntax(token, "',' or ')'")),
                _ => return Err(syntax(token, "',', ')' or identifier")),
            }
        }
    }

    /// The value after `=`, `==`, `!=`, `>` or `<`; nothing before `,` or the end is the
    /// empty value.
    fn parse_exact_value(&mut self) -> Result<&'s str> {
        let token = self.peek();
        match token.kind {
            TokenKind::End | TokenKind::Comma => Ok(""),
            TokenKind::Identifier => {
                self.next();
                Ok(token.text)
            }
            _ => Err(syntax(token, "identifier")),
        }
    }
}

fn syntax(token: Token<'_>, expected: &'static str) -> SelectorError {
    SelectorError::Syntax {
        position: token.offset,
        found: (token.kind != TokenKind::End).then(|| token.text.to_owned()),
        expected,
    }
}

// ---------------------------------------------------------------------------
// Field selectors
// ---------------------------------------------------------------------------

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
    use serde_json::json;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn parse(s: &str) -> LabelSelector {
        LabelSelector::parse(s).unwrap_or_else(|e| panic!("parse {s:?}: {e}"))
    }

    fn parse_err(s: &str) -> String {
        match LabelSelector::parse(s) {
            Ok(sel) => panic!("{s:?} parsed as {sel:?}, expected an error"),
            Err(e) => e.to_string(),
        }
    }

    fn only(sel: &LabelSelector) -> (&str, LabelOp, Vec<&str>) {
        assert_eq!(sel.requirements().len(), 1, "{sel:?}");
        let r = &sel.requirements()[0];
        (
            r.key(),
            r.operator(),
            r.values().iter().map(String::as_str).collect(),
        )
    }

    // --- label selector parsing ---

    #[test]
    fn parses_every_operator() {
        let cases: &[(&str, &str, LabelOp, &[&str])] = &[
            ("app=web", "app", LabelOp::Equals, &["web"]),
            ("app==web", "app", LabelOp::DoubleEquals, &["web"]),
            ("app!=web", "app", LabelOp::NotEquals, &["web"]),
            ("app in (web,db)", "app", LabelOp::In, &["db", "web"]),
            ("app notin (web)", "app", LabelOp::NotIn, &["web"]),
            ("app", "app", LabelOp::Exists, &[]),
            ("!app", "app", LabelOp::DoesNotExist, &[]),
            ("replicas>3", "replicas", LabelOp::GreaterThan, &["3"]),
            ("replicas<10", "replicas", LabelOp::LessThan, &["10"]),
        ];
        for (input, key, op, values) in cases {
            let sel = parse(input);
            assert_eq!(only(&sel), (*key, *op, values.to_vec()), "{input}");
        }
    }

    #[test]
    fn empty_and_blank_strings_select_everything() {
        for input in ["", " ", " \t\r\n "] {
            let sel = parse(input);
            assert!(sel.is_empty(), "{input:?}");
            assert!(sel.matches_map(&labels(&[("a", "b")])));
            assert_eq!(sel.to_string(), "");
        }
    }

    #[test]
    fn tolerates_whitespace_between_tokens() {
        let sel = parse("  a = b ,c in ( x , y ) , ! d,e  !=  f , g\tnotin(h)\n");
        assert_eq!(sel.to_string(), "a=b,c in (x,y),!d,e!=f,g notin (h)");
    }

    #[test]
    fn whitespace_inside_a_term_without_operator_is_an_error() {
        let err = parse_err("a b");
        assert!(err.contains("position 2"), "{err}");
        assert!(err.contains("found 'b'"), "{err}");
        assert!(err.contains("=, ==, !=, in, notin, >, <"), "{err}");
    }

    #[test]
    fn sorts_requirements_by_key() {
        let sel = parse("z=1,a,m in (x)");
        let keys: Vec<&str> = sel.requirements().iter().map(Requirement::key).collect();
        assert_eq!(keys, ["a", "m", "z"]);
    }

    #[test]
    fn missing_exact_value_is_the_empty_value() {
        let sel = parse("a=,b!=");
        assert_eq!(sel.requirements()[0].values(), [""]);
        assert_eq!(sel.requirements()[1].values(), [""]);
        assert!(sel.matches_map(&labels(&[("a", ""), ("b", "x")])));
        assert!(!sel.matches_map(&labels(&[("a", "x")])));
    }

    #[test]
    fn empty_slots_in_a_set_are_the_empty_value() {
        assert_eq!(only(&parse("a in ()")).2, [""]);
        assert_eq!(only(&parse("a in (,x)")).2, ["", "x"]);
        assert_eq!(only(&parse("a in (x,)")).2, ["", "x"]);
        assert_eq!(only(&parse("a in (x,,y)")).2, ["", "x", "y"]);
        assert_eq!(only(&parse("a in (,)")).2, [""]);
    }

    #[test]
    fn set_values_are_sorted_and_deduplicated() {
        assert_eq!(only(&parse("a in (c,b,c,a)")).2, ["a", "b", "c"]);
    }

    #[test]
    fn keywords_are_identifiers_outside_operator_position() {
        let sel = parse("in in (in,notin),notin=in");
        assert_eq!(sel.to_string(), "in in (in,notin),notin=in");
        assert!(sel.matches_map(&labels(&[("in", "notin"), ("notin", "in")])));
        assert_eq!(only(&parse("in")), ("in", LabelOp::Exists, vec![]));
        assert_eq!(
            only(&parse("!notin")),
            ("notin", LabelOp::DoesNotExist, vec![])
        );
    }

    #[test]
    fn keyword_glued_to_key_is_part_of_the_key() {
        // As in Kubernetes, `xin` is a single identifier, so the set has no operator.
        let err = parse_err("xin (a)");
        assert!(err.contains("found '('"), "{err}");
    }

    #[test]
    fn accepts_prefixed_keys() {
        let sel = parse("app.kubernetes.io/name=web,example.com/a_b-c.d");
        assert_eq!(
            sel.to_string(),
            "app.kubernetes.io/name=web,example.com/a_b-c.d"
        );
    }

    #[test]
    fn rejects_misplaced_commas() {
        let err = parse_err("a,");
        assert!(err.contains("found end of string"), "{err}");
        assert!(err.contains("after ','"), "{err}");
        let err = parse_err(",a");
        assert!(err.contains("position 0: found ','"), "{err}");
        let err = parse_err("a,,b");
        assert!(err.contains("position 2: found ','"), "{err}");
    }

    #[test]
    fn rejects_malformed_sets() {
        let err = parse_err("a in b");
        assert!(err.contains("found 'b', expected: '('"), "{err}");
        let err = parse_err("a in (b");
        assert!(
            err.contains("found end of string, expected: ',' or ')'"),
            "{err}"
        );
        let err = parse_err("a in (b c)");
        assert!(err.contains("position 8: found 'c'"), "{err}");
        let err = parse_err("a in (=)");
        assert!(
            err.contains("found '=', expected: ',', ')' or identifier"),
            "{err}"
        );
        let err = parse_err("a in");
        assert!(err.contains("found end of string, expected: '('"), "{err}");
    }

    #[test]
    fn rejects_trailing_tokens() {
        let err = parse_err("a=b c");
        assert!(
            err.contains("position 4: found 'c', expected: ',' or end of string"),
            "{err}"
        );
        let err = parse_err("a=(b)");
        assert!(err.contains("found '(', expected: identifier"), "{err}");
        let err = parse_err("a in (b))");
        assert!(
            err.contains("found ')', expected: ',' or end of string"),
            "{err}"
        );
    }

    #[test]
    fn rejects_operator_after_does_not_exist() {
        let err = parse_err("!a=b");
        assert!(err.contains("position 2: found '='"), "{err}");
        let err = parse_err("!");
        assert!(
            err.contains("found end of string, expected: identifier"),
            "{err}"
        );
        let err = parse_err("!!a");
        assert!(err.contains("found '!', expected: identifier"), "{err}");
    }

    #[test]
    fn rejects_a_requirement_starting_with_an_operator() {
        let err = parse_err("=a");
        assert!(
            err.contains("found '=', expected: '!', identifier"),
            "{err}"
        );
    }

    #[test]
    fn longest_match_lexes_not_equals_and_double_equals() {
        assert_eq!(only(&parse("a!=b")).1, LabelOp::NotEquals);
        assert_eq!(only(&parse("a==b")).1, LabelOp::DoubleEquals);
        // `===` is `==` then `=`, which is not a value.
        let err = parse_err("a===b");
        assert!(err.contains("found '=', expected: identifier"), "{err}");
    }

    #[test]
    fn rejects_invalid_keys() {
        let long_name = "a".repeat(64);
        let long_prefix = format!("{}/a", "a".repeat(254));
        let cases: &[(&str, &str)] = &[
            ("-a=b", "name part must consist of alphanumeric"),
            ("a-=b", "name part must consist of alphanumeric"),
            ("a/b/c=d", "at most one '/'"),
            ("/a=b", "prefix part must be non-empty"),
            ("a/=b", "name part must be non-empty"),
            ("Example.com/a=b", "lowercase RFC 1123 subdomain"),
            ("ex..com/a=b", "lowercase RFC 1123 subdomain"),
            (&format!("{long_name}=b"), "no more than 63 characters"),
            (&long_prefix, "no more than 253 characters"),
            ("ключ=b", "name part must consist of alphanumeric"),
        ];
        for (input, reason) in cases {
            let err = parse_err(input);
            assert!(err.starts_with("invalid label key \""), "{input}: {err}");
            assert!(err.contains(reason), "{input}: {err}");
        }
    }

    #[test]
    fn accepts_keys_at_the_length_limits() {
        let key = format!("{}/{}", "a".repeat(253), "b".repeat(63));
        assert_eq!(only(&parse(&key)).0, key);
    }

    #[test]
    fn rejects_invalid_values() {
        let err = parse_err("a=-b");
        assert!(
            err.contains("invalid label value \"-b\" for key \"a\""),
            "{err}"
        );
        let err = parse_err(&format!("a in (x,{})", "v".repeat(64)));
        assert!(err.contains("no more than 63 characters"), "{err}");
        let err = parse_err("a!=b/c");
        assert!(err.contains("invalid label value \"b/c\""), "{err}");
        assert_eq!(only(&parse(&format!("a={}", "v".repeat(63)))).2.len(), 1);
    }

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

    #[test]
    fn syntax_errors_name_the_position() {
        let err = LabelSelector::parse("a=b,c in x").unwrap_err();
        assert_eq!(
            err,
            SelectorError::Syntax {
                position: 9,
                found: Some("x".to_owned()),
                expected: "'('",
            }
        );
        assert_eq!(
            err.to_string(),
            "unable to parse label selector: at position 9: found 'x', expected: '('"
        );
    }

    #[test]
    fn from_str_is_parse() {
        let sel: LabelSelector = "a=b".parse().unwrap();
        assert_eq!(sel, parse("a=b"));
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

    // --- field selectors ---

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
