//! Field ownership: which manager set which fields of an object, as Kubernetes keeps
//! it in `metadata.managedFields` for server-side apply.
//!
//! A [`FieldSet`] is a trie of [`PathElement`]s. Its wire form is FieldsV1: a JSON
//! object whose keys are `f:<field>` (a field of a struct or a key of a map),
//! `k:{"name":"web"}` (an element of a list keyed by its merge keys), `v:<json>` (an
//! element of a set) or `i:<n>` (a list position), and `.` marks a node that is
//! itself in the set when it also has children.
//!
//! How a value's lists merge depends on its type ([`Schema`]): built-in kinds use the
//! list types Kubernetes declares for its API types ([`crate::fieldmanager::merge_keys`], since the
//! `k8s-openapi` schemas do not carry them), custom resources use the
//! `x-kubernetes-list-type` / `x-kubernetes-list-map-keys` / `x-kubernetes-map-type`
//! extensions of their CRD's schema, and anything else is "deduced": maps merge key by
//! key, lists are replaced whole.
//!
//! Every write records its manager here ([`record_update`], through
//! [`crate::fieldmanager::field_manager`]); [`crate::fieldmanager::structured_merge`]
//! builds on the same sets for server-side apply.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Map, Value, json};
use trellis_api::ApiError;
use trellis_api::status::StatusCause;

use crate::fieldmanager::merge_keys::ListKind;
use crate::object::{Object, metadata, metadata_mut, remove_meta};

/// The most characters a field manager's name may have, as Kubernetes allows.
pub const MAX_MANAGER_LEN: usize = 128;

/// One step of a path into an object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathElement {
    /// A field of a struct or a key of a map.
    Field(String),
    /// An element of an associative list: its key fields with their values as JSON
    /// text, sorted by field name.
    Key(Vec<(String, String)>),
    /// An element of a set, as JSON text.
    Value(String),
    /// An element of a list by position.
    Index(usize),
}

pub type Path = Vec<PathElement>;

impl PathElement {
    fn field(name: &str) -> Self {
        Self::Field(name.to_owned())
    }

    fn to_fields_v1(&self) -> String {
        match self {
            Self::Field(f) => format!("f:{f}"),
            Self::Key(keys) => format!("k:{}", key_json(keys)),
            Self::Value(v) => format!("v:{v}"),
            Self::Index(i) => format!("i:{i}"),
        }
    }

    fn from_fields_v1(raw: &str) -> Result<Self, String> {
        let (kind, rest) = raw
            .split_once(':')
            .ok_or_else(|| format!("path element {raw:?} has no prefix"))?;
        match kind {
            "f" => Ok(Self::Field(rest.to_owned())),
            "k" => {
                let map: Map<String, Value> = serde_json::from_str(rest)
                    .map_err(|e| format!("key {rest:?} is not a JSON object: {e}"))?;
                let mut keys: Vec<(String, String)> =
                    map.into_iter().map(|(k, v)| (k, v.to_string())).collect();
                keys.sort();
                Ok(Self::Key(keys))
            }
            "v" => {
                let v: Value = serde_json::from_str(rest)
                    .map_err(|e| format!("value {rest:?} is not JSON: {e}"))?;
                Ok(Self::Value(v.to_string()))
            }
            "i" => rest
                .parse()
                .map(Self::Index)
                .map_err(|_| format!("index {rest:?} is not a number")),
            other => Err(format!("unknown path element prefix {other:?}")),
        }
    }
}

fn key_json(keys: &[(String, String)]) -> String {
    let parts: Vec<String> = keys
        .iter()
        .map(|(k, v)| format!("{}:{v}", Value::String(k.clone())))
        .collect();
    format!("{{{}}}", parts.join(","))
}

/// A path as Kubernetes prints it in conflicts: `.spec.containers[name="web"].image`.
#[derive(Debug)]
pub struct DisplayPath<'a>(pub &'a [PathElement]);

impl fmt::Display for DisplayPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for element in self.0 {
            match element {
                PathElement::Field(name) => write!(f, ".{name}")?,
                PathElement::Key(keys) => {
                    let parts: Vec<String> = keys.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    write!(f, "[{}]", parts.join(","))?
                }
                PathElement::Value(v) => write!(f, "[={v}]")?,
                PathElement::Index(i) => write!(f, "[{i}]")?,
            }
        }
        Ok(())
    }
}

/// A set of paths into an object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FieldSet {
    /// The node itself is in the set (not only some of its children).
    member: bool,
    children: BTreeMap<PathElement, FieldSet>,
}

impl FieldSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        !self.member && self.children.values().all(FieldSet::is_empty)
    }

    pub fn insert(&mut self, path: &[PathElement]) {
        match path.split_first() {
            None => self.member = true,
            Some((first, rest)) => self.children.entry(first.clone()).or_default().insert(rest),
        }
    }

    fn node(&self, path: &[PathElement]) -> Option<&FieldSet> {
        match path.split_first() {
            None => Some(self),
            Some((first, rest)) => self.children.get(first)?.node(rest),
        }
    }

    pub fn contains(&self, path: &[PathElement]) -> bool {
        self.node(path).is_some_and(|n| n.member)
    }

    /// Whether the set holds `path` or anything below it.
    pub fn covers(&self, path: &[PathElement]) -> bool {
        self.node(path).is_some_and(|n| !n.is_empty())
    }

    pub fn union(&mut self, other: &FieldSet) {
        self.member |= other.member;
        for (k, v) in &other.children {
            self.children.entry(k.clone()).or_default().union(v);
        }
    }

    pub fn difference(&self, other: &FieldSet) -> FieldSet {
        let mut out = FieldSet {
            member: self.member && !other.member,
            children: BTreeMap::new(),
        };
        for (k, v) in &self.children {
            let child = match other.children.get(k) {
                Some(o) => v.difference(o),
                None => v.clone(),
            };
            if !child.is_empty() {
                out.children.insert(k.clone(), child);
            }
        }
        out
    }

    pub fn intersection(&self, other: &FieldSet) -> FieldSet {
        let mut out = FieldSet {
            member: self.member && other.member,
            children: BTreeMap::new(),
        };
        for (k, v) in &self.children {
            if let Some(o) = other.children.get(k) {
                let child = v.intersection(o);
                if !child.is_empty() {
                    out.children.insert(k.clone(), child);
                }
            }
        }
        out
    }

    /// Every path in the set, parents before their children.
    pub fn paths(&self) -> Vec<Path> {
        let mut out = Vec::new();
        self.collect(&mut Vec::new(), &mut out, false);
        out
    }

    /// The paths in the set that have nothing of the set below them.
    pub fn leaves(&self) -> Vec<Path> {
        let mut out = Vec::new();
        self.collect(&mut Vec::new(), &mut out, true);
        out
    }

    fn collect(&self, prefix: &mut Path, out: &mut Vec<Path>, leaves_only: bool) {
        let has_children = self.children.values().any(|c| !c.is_empty());
        if self.member && !prefix.is_empty() && !(leaves_only && has_children) {
            out.push(prefix.clone());
        }
        for (k, v) in &self.children {
            prefix.push(k.clone());
            v.collect(prefix, out, leaves_only);
            prefix.pop();
        }
    }

    fn remove(&mut self, path: &[PathElement]) {
        match path.split_first() {
            None => {
                self.member = false;
                self.children.clear();
            }
            Some((first, rest)) => {
                if let Some(child) = self.children.get_mut(first) {
                    child.remove(rest);
                    if child.is_empty() {
                        self.children.remove(first);
                    }
                }
            }
        }
    }

    /// The FieldsV1 form.
    pub fn to_fields_v1(&self) -> Value {
        let mut map = Map::new();
        let has_children = self.children.values().any(|c| !c.is_empty());
        if self.member && has_children {
            map.insert(".".into(), json!({}));
        }
        for (k, v) in &self.children {
            if !v.is_empty() {
                map.insert(k.to_fields_v1(), v.to_fields_v1());
            }
        }
        Value::Object(map)
    }

    pub fn from_fields_v1(v: &Value) -> Result<FieldSet, String> {
        Self::parse_node(v, true)
    }

    /// A node of FieldsV1; below the root, `{}` is a member without children.
    fn parse_node(v: &Value, root: bool) -> Result<FieldSet, String> {
        let map = v.as_object().ok_or("fieldsV1 must be an object")?;
        let mut set = FieldSet {
            member: map.is_empty() && !root,
            children: BTreeMap::new(),
        };
        for (k, child) in map {
            if k == "." {
                set.member = true;
                continue;
            }
            let element = PathElement::from_fields_v1(k)?;
            set.children
                .insert(element, FieldSet::parse_node(child, false)?);
        }
        Ok(set)
    }
}

/// How the elements of a list are identified when lists merge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListType {
    /// Replaced as a whole.
    Atomic,
    /// Scalars, each its own element.
    Set,
    /// Objects keyed by these fields.
    Map(Vec<String>),
}

/// What is known of a value's type.
#[derive(Clone, Copy, Debug)]
pub enum Schema<'a> {
    /// A built-in kind.
    Builtin,
    /// A node of a custom resource's `openAPIV3Schema`.
    Crd(&'a Value),
    /// Nothing: maps merge by key, lists are atomic.
    Deduced,
}

/// How a list of the built-in kinds merges ([`crate::fieldmanager::merge_keys::rule_at`]); `path`
/// is the list's parent.
fn builtin_list_type(path: &[PathElement], field: &str) -> ListType {
    let parent: Vec<&str> = path
        .iter()
        .filter_map(|p| match p {
            PathElement::Field(f) => Some(f.as_str()),
            _ => None,
        })
        .collect();
    match crate::fieldmanager::merge_keys::rule_at(&parent, field).map(|r| r.list) {
        Some(ListKind::Set) => ListType::Set,
        Some(ListKind::Map(keys)) => ListType::Map(keys.iter().map(|k| (*k).to_owned()).collect()),
        Some(ListKind::Atomic) | None => ListType::Atomic,
    }
}

/// Structs and maps of the built-in kinds that are replaced as a whole
/// (`+structType=atomic`, `+mapType=atomic`).
fn builtin_atomic_map(path: &[PathElement], field: &str) -> bool {
    matches!(field, "selector" | "nodeSelector" | "roleRef")
        && path.first() != Some(&PathElement::field("metadata"))
}

/// The value a key field takes when an element omits it: Kubernetes' schemas default
/// these, so `{containerPort: 80}` and `{containerPort: 80, protocol: TCP}` are one port.
fn key_default(field: &str) -> Option<Value> {
    (field == "protocol").then(|| json!("TCP"))
}

impl<'a> Schema<'a> {
    /// The schema of field `name` of an object of this schema.
    pub fn field(self, name: &str, at_root: bool) -> Schema<'a> {
        match self {
            Schema::Crd(_) if at_root && name == "metadata" => Schema::Builtin,
            Schema::Crd(s) => {
                let declared = s
                    .get("properties")
                    .and_then(|p| p.get(name))
                    .or_else(|| s.get("additionalProperties").filter(|a| a.is_object()));
                match declared {
                    Some(child) => Schema::Crd(child),
                    None => Schema::Deduced,
                }
            }
            other => other,
        }
    }

    /// The schema of a list's elements.
    pub fn items(self) -> Schema<'a> {
        match self {
            Schema::Crd(s) => s.get("items").map_or(Schema::Deduced, Schema::Crd),
            other => other,
        }
    }

    /// How the list at `path` (its last element is the list's field) merges.
    pub fn list_type(self, path: &[PathElement]) -> ListType {
        match self {
            Schema::Builtin => match path.split_last() {
                Some((PathElement::Field(f), parent)) => builtin_list_type(parent, f),
                _ => ListType::Atomic,
            },
            Schema::Crd(s) => match s.get("x-kubernetes-list-type").and_then(Value::as_str) {
                Some("set") => ListType::Set,
                Some("map") => ListType::Map(
                    s.get("x-kubernetes-list-map-keys")
                        .and_then(Value::as_array)
                        .map(|keys| {
                            keys.iter()
                                .filter_map(Value::as_str)
                                .map(str::to_owned)
                                .collect()
                        })
                        .unwrap_or_default(),
                ),
                _ => ListType::Atomic,
            },
            Schema::Deduced => ListType::Atomic,
        }
    }

    /// Whether the struct at `path` exists whenever its parent does (a field that is
    /// not a pointer in Kubernetes' Go types): no one creates it, so an update does not
    /// own it itself, only what it holds.
    pub fn always_present(self, path: &[PathElement]) -> bool {
        matches!(self, Schema::Builtin)
            && matches!(path.last(), Some(PathElement::Field(f))
                if matches!(f.as_str(), "spec" | "status" | "template" | "metadata" | "strategy"))
    }

    /// Whether the map or struct at `path` is replaced as a whole.
    pub fn atomic_map(self, path: &[PathElement]) -> bool {
        match self {
            Schema::Builtin => match path.split_last() {
                Some((PathElement::Field(f), parent)) => builtin_atomic_map(parent, f),
                _ => false,
            },
            Schema::Crd(s) => {
                s.get("x-kubernetes-map-type").and_then(Value::as_str) == Some("atomic")
            }
            Schema::Deduced => false,
        }
    }
}

/// The key of an element of an associative list, or `None` if it is not an object or
/// lacks a key field that has no default.
pub fn key_of(item: &Value, keys: &[String]) -> Option<PathElement> {
    let obj = item.as_object()?;
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        let v = match obj.get(k).filter(|v| !v.is_null()) {
            Some(v) => v.clone(),
            None => key_default(k)?,
        };
        out.push((k.clone(), v.to_string()));
    }
    if out.is_empty() {
        return None;
    }
    out.sort();
    Some(PathElement::Key(out))
}

/// Whether every element of `items` has a key (lists that do not merge as atomic).
pub fn keyed(items: &[Value], keys: &[String]) -> bool {
    items.iter().all(|i| key_of(i, keys).is_some())
}

/// The fields `value` sets. With `with_parents`, maps and sets are in the set
/// themselves too (what an update records: it created them); without, only what an
/// applied configuration states: its leaves and list elements.
pub fn fields_of(value: &Value, schema: Schema<'_>, with_parents: bool) -> FieldSet {
    let mut out = FieldSet::new();
    walk(value, schema, &mut Vec::new(), with_parents, &mut out);
    out
}

fn walk(
    value: &Value,
    schema: Schema<'_>,
    path: &mut Path,
    with_parents: bool,
    out: &mut FieldSet,
) {
    match value {
        Value::Object(map) => {
            if !path.is_empty() && (map.is_empty() || schema.atomic_map(path)) {
                out.insert(path);
                return;
            }
            if with_parents && !path.is_empty() && !schema.always_present(path) {
                out.insert(path);
            }
            let at_root = path.is_empty();
            for (k, v) in map {
                if v.is_null() {
                    continue;
                }
                path.push(PathElement::Field(k.clone()));
                walk(v, schema.field(k, at_root), path, with_parents, out);
                path.pop();
            }
        }
        Value::Array(items) => match schema.list_type(path) {
            ListType::Set if !items.is_empty() => {
                if with_parents {
                    out.insert(path);
                }
                for item in items {
                    path.push(PathElement::Value(item.to_string()));
                    out.insert(path);
                    path.pop();
                }
            }
            ListType::Map(keys) if !items.is_empty() && keyed(items, &keys) => {
                let item_schema = schema.items();
                for item in items {
                    let Some(key) = key_of(item, &keys) else {
                        continue;
                    };
                    path.push(key);
                    out.insert(path);
                    if let Value::Object(fields) = item {
                        for (k, v) in fields {
                            if v.is_null() {
                                continue;
                            }
                            path.push(PathElement::Field(k.clone()));
                            walk(v, item_schema.field(k, false), path, with_parents, out);
                            path.pop();
                        }
                    }
                    path.pop();
                }
            }
            _ => out.insert(path),
        },
        _ => {
            if !path.is_empty() {
                out.insert(path);
            }
        }
    }
}

/// Whether `e` is the set element written as JSON `text`.
fn is_value(e: &Value, text: &str) -> bool {
    serde_json::to_string(e).is_ok_and(|t| t == text)
}

/// The value at `path`, if the object has one.
pub fn value_at<'v>(value: &'v Value, path: &[PathElement]) -> Option<&'v Value> {
    let Some((first, rest)) = path.split_first() else {
        return Some(value);
    };
    let next = match first {
        PathElement::Field(f) => value.as_object()?.get(f)?,
        PathElement::Index(i) => value.as_array()?.get(*i)?,
        PathElement::Value(v) => value.as_array()?.iter().find(|e| is_value(e, v))?,
        PathElement::Key(keys) => {
            let names: Vec<String> = keys.iter().map(|(k, _)| k.clone()).collect();
            value
                .as_array()?
                .iter()
                .find(|e| key_of(e, &names).as_ref() == Some(first))?
        }
    };
    value_at(next, rest)
}

/// Removes the value at `path`; whether there was one.
pub fn remove_at(value: &mut Value, path: &[PathElement]) -> bool {
    let Some((last, parent_path)) = path.split_last() else {
        return false;
    };
    let Some(parent) = value_at_mut(value, parent_path) else {
        return false;
    };
    match (last, parent) {
        (PathElement::Field(f), Value::Object(map)) => map.remove(f).is_some(),
        (PathElement::Index(i), Value::Array(items)) if *i < items.len() => {
            items.remove(*i);
            true
        }
        (PathElement::Value(v), Value::Array(items)) => {
            let before = items.len();
            items.retain(|e| !is_value(e, v));
            items.len() != before
        }
        (PathElement::Key(keys), Value::Array(items)) => {
            let names: Vec<String> = keys.iter().map(|(k, _)| k.clone()).collect();
            let before = items.len();
            items.retain(|e| key_of(e, &names).as_ref() != Some(last));
            items.len() != before
        }
        _ => false,
    }
}

pub fn value_at_mut<'v>(value: &'v mut Value, path: &[PathElement]) -> Option<&'v mut Value> {
    let Some((first, rest)) = path.split_first() else {
        return Some(value);
    };
    let next = match first {
        PathElement::Field(f) => value.as_object_mut()?.get_mut(f)?,
        PathElement::Index(i) => value.as_array_mut()?.get_mut(*i)?,
        PathElement::Value(v) => value.as_array_mut()?.iter_mut().find(|e| is_value(e, v))?,
        PathElement::Key(keys) => {
            let names: Vec<String> = keys.iter().map(|(k, _)| k.clone()).collect();
            value
                .as_array_mut()?
                .iter_mut()
                .find(|e| key_of(e, &names).as_ref() == Some(first))?
        }
    };
    value_at_mut(next, rest)
}

/// Metadata the server owns: never in anyone's field set.
const SERVER_METADATA: &[&str] = &[
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "resourceVersion",
    "generation",
    "managedFields",
    "selfLink",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "initializers",
];

/// Which part of an object a write may change, so only that part is owned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The whole object.
    All,
    /// The main resource of a kind with a `status` subresource: everything but status.
    NoStatus,
    /// The `status` subresource: status (and labels and annotations).
    Status,
}

/// Drops from `set` what no manager owns: identity, server metadata, and what the
/// write's scope does not reach.
pub fn strip(set: &mut FieldSet, scope: Scope) {
    set.member = false;
    set.remove(&[PathElement::field("apiVersion")]);
    set.remove(&[PathElement::field("kind")]);
    if let Some(meta) = set.children.get_mut(&PathElement::field("metadata")) {
        meta.member = false;
        for field in SERVER_METADATA {
            meta.remove(&[PathElement::field(field)]);
        }
    }
    match scope {
        Scope::All => {}
        Scope::NoStatus => set.remove(&[PathElement::field("status")]),
        Scope::Status => {
            set.children.retain(|k, _| {
                *k == PathElement::field("status") || *k == PathElement::field("metadata")
            });
            if let Some(meta) = set.children.get_mut(&PathElement::field("metadata")) {
                meta.children.retain(|k, _| {
                    *k == PathElement::field("labels") || *k == PathElement::field("annotations")
                });
            }
        }
    }
    set.children.retain(|_, v| !v.is_empty());
}

/// One entry of `metadata.managedFields`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub manager: String,
    /// `Apply` or `Update`.
    pub operation: String,
    pub api_version: String,
    pub time: Option<String>,
    pub subresource: String,
    pub fields: FieldSet,
}

impl Entry {
    pub fn is_apply(&self) -> bool {
        self.operation == "Apply"
    }

    /// Whether `self` and `other` are the same manager: appliers are one whatever
    /// version they apply, updaters are one per version, as Kubernetes keys them.
    pub fn same_manager(&self, other: &Entry) -> bool {
        self.manager == other.manager
            && self.operation == other.operation
            && self.subresource == other.subresource
            && (self.is_apply() || self.api_version == other.api_version)
    }

    /// The manager as Kubernetes names it in a conflict:
    /// `"kubectl-client-side-apply" using apps/v1`.
    pub fn describe(&self) -> String {
        let mut out = format!("{:?}", self.manager);
        if !self.subresource.is_empty() {
            out.push_str(&format!(" with subresource {:?}", self.subresource));
        }
        if !self.is_apply() {
            out.push_str(&format!(" using {}", self.api_version));
        }
        out
    }

    fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("manager".into(), self.manager.clone().into());
        m.insert("operation".into(), self.operation.clone().into());
        m.insert("apiVersion".into(), self.api_version.clone().into());
        if let Some(t) = &self.time {
            m.insert("time".into(), t.clone().into());
        }
        m.insert("fieldsType".into(), "FieldsV1".into());
        m.insert("fieldsV1".into(), self.fields.to_fields_v1());
        if !self.subresource.is_empty() {
            m.insert("subresource".into(), self.subresource.clone().into());
        }
        Value::Object(m)
    }

    fn from_value(v: &Value) -> Result<Entry, String> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        if !v.is_object() {
            return Err("a managedFields entry must be an object".into());
        }
        let fields = match v.get("fieldsV1") {
            None | Some(Value::Null) => FieldSet::new(),
            Some(f) => FieldSet::from_fields_v1(f)?,
        };
        Ok(Entry {
            manager: s("manager"),
            operation: s("operation"),
            api_version: s("apiVersion"),
            time: v.get("time").and_then(Value::as_str).map(str::to_owned),
            subresource: s("subresource"),
            fields,
        })
    }

    /// The fieldsType this entry was sent with, checked by [`validate`].
    fn fields_type(v: &Value) -> &str {
        v.get("fieldsType").and_then(Value::as_str).unwrap_or("")
    }
}

/// The managedFields of `obj`: `None` when it has none or they cannot be read (an
/// unreadable list is ignored, as Kubernetes ignores it).
pub fn decode(obj: &Object) -> Option<Vec<Entry>> {
    let list = metadata(obj)?.get("managedFields")?.as_array()?;
    if list.is_empty() {
        return None;
    }
    list.iter()
        .map(Entry::from_value)
        .collect::<Result<_, _>>()
        .ok()
}

/// Checks the entries a client sent, as Kubernetes validates `metadata.managedFields`.
pub fn validate(obj: &Object) -> Vec<StatusCause> {
    let mut causes = Vec::new();
    let Some(list) = metadata(obj)
        .and_then(|m| m.get("managedFields"))
        .and_then(Value::as_array)
    else {
        return causes;
    };
    for (i, raw) in list.iter().enumerate() {
        let Ok(entry) = Entry::from_value(raw) else {
            continue;
        };
        if entry.fields.is_empty() {
            // Dropped when written: `[{}]` is how a client clears the list.
            continue;
        }
        let at = format!("metadata.managedFields[{i}]");
        if entry.operation != "Apply" && entry.operation != "Update" {
            causes.push(StatusCause::new(
                "FieldValueNotSupported",
                format!("{at}.operation"),
                format!(
                    "Unsupported value: {:?}: supported values: \"Apply\", \"Update\"",
                    entry.operation
                ),
            ));
        }
        let fields_type = Entry::fields_type(raw);
        if !fields_type.is_empty() && fields_type != "FieldsV1" {
            causes.push(StatusCause::invalid(
                format!("{at}.fieldsType"),
                fields_type,
                "must be `FieldsV1`",
            ));
        }
        if entry.manager.chars().count() > MAX_MANAGER_LEN {
            causes.push(StatusCause::new(
                "FieldValueTooLong",
                format!("{at}.manager"),
                format!("Too long: may not be more than {MAX_MANAGER_LEN} bytes"),
            ));
        }
    }
    causes
}

/// Writes `entries` (those that own something) into `obj`, appliers first, then by
/// time and manager.
pub fn encode(obj: &mut Object, mut entries: Vec<Entry>) {
    entries.retain(|e| !e.fields.is_empty());
    entries.sort_by(|a, b| {
        (!a.is_apply(), &a.time, &a.manager).cmp(&(!b.is_apply(), &b.time, &b.manager))
    });
    if entries.is_empty() {
        remove_meta(obj, "managedFields");
        return;
    }
    let list: Vec<Value> = entries.iter().map(Entry::to_value).collect();
    metadata_mut(obj).insert("managedFields".into(), Value::Array(list));
}

/// `obj` without its managedFields, as field sets are computed.
pub fn without_managed_fields(obj: &Object) -> Value {
    let mut copy = obj.clone();
    remove_meta(&mut copy, "managedFields");
    Value::Object(copy)
}

/// The manager of a write: the `fieldManager` query parameter, else the client's
/// User-Agent up to its first `/`, as Kubernetes derives it (`kubectl/v1.32.0 (…)`
/// → `kubectl`).
pub fn manager_name(field_manager: Option<&str>, user_agent: Option<&str>) -> String {
    match field_manager.filter(|m| !m.is_empty()) {
        Some(m) => m.to_owned(),
        None => {
            let agent = user_agent.unwrap_or("").split('/').next().unwrap_or("");
            agent.chars().take(MAX_MANAGER_LEN).collect()
        }
    }
}

/// Checks a `fieldManager` query parameter; `options` names the kind of options it
/// came with (`PatchOptions`, `CreateOptions`, `UpdateOptions`).
pub fn check_manager(field_manager: Option<&str>, options: &str) -> Result<(), ApiError> {
    let Some(m) = field_manager else {
        return Ok(());
    };
    let cause = if m.chars().count() > MAX_MANAGER_LEN {
        StatusCause::new(
            "FieldValueTooLong",
            "fieldManager",
            format!("Too long: may not be more than {MAX_MANAGER_LEN} bytes"),
        )
    } else if m.chars().any(|c| c.is_control()) {
        StatusCause::invalid("fieldManager", m, "must consist of printable characters")
    } else {
        return Ok(());
    };
    Err(ApiError::invalid("meta.k8s.io", options, "", vec![cause]))
}

/// Records a non-apply write of `old` (none for a create) into `new`'s managedFields:
/// `manager` now owns what it added or changed, other managers lose it, and fields
/// that are gone are no one's. Managed fields the client sent replace the stored
/// ones first (`[{}]` clears them); unreadable ones are ignored.
#[allow(clippy::too_many_arguments)]
pub fn record_update(
    old: Option<&Object>,
    new: &mut Object,
    schema: Schema<'_>,
    scope: Scope,
    manager: &str,
    api_version: &str,
    subresource: &str,
    now: &str,
) -> Result<(), Vec<StatusCause>> {
    let sent = decode(new);
    let mut entries = match sent {
        Some(e) if old.and_then(decode).as_ref() != Some(&e) => {
            let causes = validate(new);
            if !causes.is_empty() {
                return Err(causes);
            }
            e
        }
        _ => old.and_then(decode).unwrap_or_default(),
    };
    let old_value = old.map(without_managed_fields).unwrap_or(Value::Null);
    // The new object is read in place rather than copied without its managedFields
    // (a copy of every object written was measurable): they are dropped here and
    // written again by `encode` below.
    if let Some(Value::Object(meta)) = new.get_mut("metadata") {
        meta.remove("managedFields");
    }
    let new_value = Value::Object(std::mem::take(new));
    let mut old_fields = fields_of(&old_value, schema, true);
    let mut new_fields = fields_of(&new_value, schema, true);
    strip(&mut old_fields, scope);
    strip(&mut new_fields, scope);
    let mut changed = new_fields.difference(&old_fields);
    // On a create every field is new, and `changed` holds them all already.
    if old.is_some() {
        for path in new_fields.leaves() {
            if value_at(&old_value, &path) != value_at(&new_value, &path) {
                changed.insert(&path);
            }
        }
    }
    if let Value::Object(map) = new_value {
        *new = map;
    }
    let removed = old_fields.difference(&new_fields);
    let me = Entry {
        manager: manager.to_owned(),
        operation: "Update".into(),
        api_version: api_version.to_owned(),
        time: Some(now.to_owned()),
        subresource: subresource.to_owned(),
        fields: FieldSet::new(),
    };
    let mut found = false;
    for entry in &mut entries {
        if entry.same_manager(&me) {
            found = true;
            let before = entry.fields.clone();
            entry.fields.union(&changed);
            entry.fields = entry.fields.difference(&removed);
            if entry.fields != before {
                entry.time = Some(now.to_owned());
            }
        } else {
            entry.fields = entry.fields.difference(&changed).difference(&removed);
        }
    }
    if !found && !changed.is_empty() {
        entries.push(Entry {
            fields: changed,
            ..me
        });
    }
    encode(new, entries);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Object {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn builtin_lists_take_the_keys_of_the_schema_their_path_leads_to() {
        let path = |fields: &[&str]| -> Vec<PathElement> {
            fields.iter().map(|f| PathElement::field(f)).collect()
        };
        let map = |keys: &[&str]| ListType::Map(keys.iter().map(|k| (*k).to_owned()).collect());
        let list = |fields: &[&str]| Schema::Builtin.list_type(&path(fields));
        // Ports of a container and of a Service: the same field, other keys.
        let container = vec![
            PathElement::field("spec"),
            PathElement::field("containers"),
            PathElement::Key(vec![("name".into(), "\"web\"".into())]),
            PathElement::field("ports"),
        ];
        assert_eq!(
            Schema::Builtin.list_type(&container),
            map(&["containerPort", "protocol"])
        );
        assert_eq!(list(&["spec", "ports"]), map(&["port", "protocol"]));
        assert_eq!(
            list(&["spec", "template", "spec", "containers"]),
            map(&["name"])
        );
        assert_eq!(list(&["status", "conditions"]), map(&["type"]));
        assert_eq!(list(&["metadata", "finalizers"]), ListType::Set);
        // Not in the table, and a status field outside `status`: replaced whole.
        assert_eq!(list(&["spec", "args"]), ListType::Atomic);
        assert_eq!(list(&["spec", "conditions"]), ListType::Atomic);
    }

    fn path(s: &[&str]) -> Path {
        s.iter().map(|f| PathElement::field(f)).collect()
    }

    #[test]
    fn fields_v1_round_trips_with_keys_values_and_dots() {
        let wire = json!({
            "f:metadata": {"f:labels": {".": {}, "f:app": {}}},
            "f:spec": {"f:template": {"f:spec": {"f:containers": {
                "k:{\"name\":\"web\"}": {".": {}, "f:image": {}, "f:name": {},
                    "f:ports": {"k:{\"containerPort\":80,\"protocol\":\"TCP\"}": {".": {}, "f:containerPort": {}}}}
            }}}},
            "f:finalizers": {"v:\"a/b\"": {}},
            "f:items": {"i:0": {}}
        });
        let set = FieldSet::from_fields_v1(&wire).unwrap();
        assert_eq!(set.to_fields_v1(), wire);
        assert!(set.contains(&path(&["metadata", "labels"])));
        assert!(!set.contains(&path(&["metadata"])));
        assert!(set.covers(&path(&["metadata"])));
        let image: Path = vec![
            PathElement::field("spec"),
            PathElement::field("template"),
            PathElement::field("spec"),
            PathElement::field("containers"),
            PathElement::Key(vec![("name".into(), "\"web\"".into())]),
            PathElement::field("image"),
        ];
        assert!(set.contains(&image));
        assert_eq!(
            DisplayPath(&image).to_string(),
            ".spec.template.spec.containers[name=\"web\"].image"
        );
        assert!(FieldSet::from_fields_v1(&json!({"x:y": {}})).is_err());
        assert!(FieldSet::from_fields_v1(&json!({"k:notjson": {}})).is_err());
        assert!(FieldSet::from_fields_v1(&json!([])).is_err());
    }

    #[test]
    fn applied_sets_hold_leaves_and_keyed_elements() {
        let deployment = json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "labels": {"app": "web"}},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                "template": {"spec": {"containers": [
                    {"name": "web", "image": "nginx", "ports": [{"containerPort": 80}],
                     "args": ["a", "b"]}
                ]}}}
        });
        let mut set = fields_of(&deployment, Schema::Builtin, false);
        strip(&mut set, Scope::NoStatus);
        let wire = set.to_fields_v1();
        assert_eq!(
            wire,
            json!({
                "f:metadata": {"f:labels": {"f:app": {}}},
                "f:spec": {"f:replicas": {}, "f:selector": {},
                    "f:template": {"f:spec": {"f:containers": {"k:{\"name\":\"web\"}": {
                        ".": {}, "f:name": {}, "f:image": {}, "f:args": {},
                        "f:ports": {"k:{\"containerPort\":80,\"protocol\":\"TCP\"}": {
                            ".": {}, "f:containerPort": {}}}
                    }}}}}
            })
        );
        // A port written with its default protocol is the same element.
        let port: Path = vec![
            PathElement::field("ports"),
            key_of(
                &json!({"containerPort": 80, "protocol": "TCP"}),
                &["containerPort".into(), "protocol".into()],
            )
            .unwrap(),
        ];
        assert!(value_at(&json!({"ports": [{"containerPort": 80}]}), &port).is_some());
    }

    #[test]
    fn set_operations_keep_only_members() {
        let mut a = FieldSet::new();
        a.insert(&path(&["data", "a"]));
        a.insert(&path(&["data", "b"]));
        let mut b = FieldSet::new();
        b.insert(&path(&["data", "b"]));
        b.insert(&path(&["data", "c"]));
        assert_eq!(a.difference(&b).leaves(), vec![path(&["data", "a"])]);
        assert_eq!(a.intersection(&b).leaves(), vec![path(&["data", "b"])]);
        a.union(&b);
        assert_eq!(a.leaves().len(), 3);
        assert!(a.difference(&a).is_empty());
    }

    #[test]
    fn crd_schemas_name_their_list_types() {
        let schema = json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "ports": {"type": "array", "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["port"], "items": {"type": "object"}},
            "tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
            "args": {"type": "array", "items": {"type": "string"}},
            "sel": {"type": "object", "x-kubernetes-map-type": "atomic"}
        }}}});
        let cr = json!({"metadata": {"finalizers": ["x"]}, "spec": {
            "ports": [{"port": 1, "name": "a"}], "tags": ["t"], "args": ["z"], "sel": {"a": "b"}}});
        let set = fields_of(&cr, Schema::Crd(&schema), false);
        assert_eq!(
            set.to_fields_v1(),
            json!({"f:metadata": {"f:finalizers": {"v:\"x\"": {}}}, "f:spec": {
                "f:ports": {"k:{\"port\":1}": {".": {}, "f:port": {}, "f:name": {}}},
                "f:tags": {"v:\"t\"": {}}, "f:args": {}, "f:sel": {}}})
        );
    }

    #[test]
    fn updates_take_ownership_of_what_they_change() {
        let old = obj(json!({"metadata": {"name": "c", "managedFields": [
            {"manager": "a", "operation": "Apply", "apiVersion": "v1", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:data": {"f:x": {}, "f:y": {}}}}
        ]}, "data": {"x": "1", "y": "2"}}));
        let mut new = old.clone();
        new["data"]["x"] = json!("changed");
        new["data"].as_object_mut().unwrap().remove("y");
        new["data"]["z"] = json!("3");
        record_update(
            Some(&old),
            &mut new,
            Schema::Builtin,
            Scope::All,
            "kubectl-edit",
            "v1",
            "",
            "2026-01-01T00:00:00Z",
        )
        .unwrap();
        let entries = decode(&new).unwrap();
        assert_eq!(entries.len(), 1, "a owns nothing any more: {entries:?}");
        assert_eq!(entries[0].manager, "kubectl-edit");
        assert_eq!(
            entries[0].fields.to_fields_v1(),
            json!({"f:data": {"f:x": {}, "f:z": {}}})
        );
    }

    #[test]
    fn creates_own_everything_but_server_metadata() {
        let mut new = obj(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "uid": "u", "labels": {"a": "b"}}, "data": {"k": "v"}}));
        record_update(
            None,
            &mut new,
            Schema::Builtin,
            Scope::All,
            "kubectl-create",
            "v1",
            "",
            "t",
        )
        .unwrap();
        assert_eq!(
            new["metadata"]["managedFields"][0]["fieldsV1"],
            json!({"f:data": {".": {}, "f:k": {}}, "f:metadata": {"f:labels": {".": {}, "f:a": {}}}})
        );
    }

    #[test]
    fn updates_own_maps_they_create_but_not_structs_that_always_exist() {
        let mut new = obj(json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d"}, "spec": {"replicas": 1, "template": {
                "metadata": {"labels": {"a": "b"}}, "spec": {"containers": []}}}}));
        record_update(
            None,
            &mut new,
            Schema::Builtin,
            Scope::NoStatus,
            "m",
            "apps/v1",
            "",
            "t",
        )
        .unwrap();
        assert_eq!(
            new["metadata"]["managedFields"][0]["fieldsV1"],
            json!({"f:spec": {"f:replicas": {}, "f:template": {
                "f:metadata": {"f:labels": {".": {}, "f:a": {}}},
                "f:spec": {"f:containers": {}}}}})
        );
    }

    #[test]
    fn clients_may_clear_managed_fields_but_not_send_bad_ones() {
        let old = obj(json!({"metadata": {"name": "c", "managedFields": [
            {"manager": "a", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:data": {"f:x": {}}}}
        ]}, "data": {"x": "1"}}));
        let mut cleared = old.clone();
        cleared["metadata"]["managedFields"] = json!([{}]);
        record_update(
            Some(&old),
            &mut cleared,
            Schema::Builtin,
            Scope::All,
            "m",
            "v1",
            "",
            "t",
        )
        .unwrap();
        assert!(cleared["metadata"].get("managedFields").is_none());

        let mut bad = old.clone();
        bad["metadata"]["managedFields"][0]["operation"] = json!("Delete");
        let causes = record_update(
            Some(&old),
            &mut bad,
            Schema::Builtin,
            Scope::All,
            "m",
            "v1",
            "",
            "t",
        )
        .unwrap_err();
        assert_eq!(causes[0].field, "metadata.managedFields[0].operation");

        // Unreadable fieldsV1 is ignored: the stored entries stay.
        let mut garbled = old.clone();
        garbled["metadata"]["managedFields"][0]["fieldsV1"] = json!({"bogus": {}});
        record_update(
            Some(&old),
            &mut garbled,
            Schema::Builtin,
            Scope::All,
            "m",
            "v1",
            "",
            "t",
        )
        .unwrap();
        assert_eq!(
            garbled["metadata"]["managedFields"],
            old["metadata"]["managedFields"]
        );
    }

    #[test]
    fn managers_come_from_the_query_or_the_user_agent() {
        assert_eq!(manager_name(Some("x"), Some("kubectl/v1")), "x");
        assert_eq!(
            manager_name(None, Some("kubectl/v1.32.0 (linux/amd64) kubernetes/abc")),
            "kubectl"
        );
        assert_eq!(manager_name(None, None), "");
        assert!(check_manager(Some(&"m".repeat(129)), "PatchOptions").is_err());
        assert!(check_manager(Some("ok"), "PatchOptions").is_ok());
    }
}
