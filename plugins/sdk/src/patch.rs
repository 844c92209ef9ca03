//! RFC 6902 JSON Patch, built op by op or computed as a diff.
//!
//! Paths are RFC 6901 JSON Pointers. Build them with [`pointer!`](crate::pointer)
//! so that keys like `app.kubernetes.io/name` are escaped (`~` → `~0`, `/` → `~1`):
//!
//! ```
//! use serde_json::json;
//! use trellis_plugin::{Patch, pointer};
//!
//! let pod = json!({"metadata": {"name": "web"}, "spec": {"containers": [{"name": "app"}]}});
//! let patch = Patch::new()
//!     .set_label(&pod, "app.kubernetes.io/managed-by", "trellis")
//!     .add(pointer!("spec", "containers", 0, "imagePullPolicy"), json!("Always"));
//! assert_eq!(
//!     patch.apply(&pod).unwrap()["metadata"]["labels"]["app.kubernetes.io/managed-by"],
//!     "trellis"
//! );
//! assert_eq!(patch.ops()[0].path(), "/metadata/labels");
//! ```

use std::{borrow::Cow, fmt};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Escapes one reference token of a JSON Pointer (RFC 6901 §3).
pub fn escape(token: &str) -> Cow<'_, str> {
    if token.contains(['~', '/']) {
        Cow::Owned(token.replace('~', "~0").replace('/', "~1"))
    } else {
        Cow::Borrowed(token)
    }
}

/// A JSON Pointer built from unescaped tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Pointer(String);

impl Pointer {
    /// The whole document (`""`).
    pub fn root() -> Self {
        Self(String::new())
    }

    /// Appends one token: a map key (escaped here) or an array index.
    pub fn push(mut self, token: impl fmt::Display) -> Self {
        self.0.push('/');
        self.0.push_str(&escape(&token.to_string()));
        self
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Pointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Pointer> for String {
    fn from(p: Pointer) -> Self {
        p.0
    }
}

/// `pointer!("metadata", "labels", key)` → `/metadata/labels/<key escaped>`.
#[macro_export]
macro_rules! pointer {
    ($($token:expr),* $(,)?) => {
        $crate::patch::Pointer::root()$(.push($token))*
    };
}

/// One patch operation. `path` and `from` are already-escaped JSON Pointers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum PatchOp {
    Add { path: String, value: Value },
    Remove { path: String },
    Replace { path: String, value: Value },
    Move { from: String, path: String },
    Copy { from: String, path: String },
    Test { path: String, value: Value },
}

impl PatchOp {
    pub fn path(&self) -> &str {
        match self {
            PatchOp::Add { path, .. }
            | PatchOp::Remove { path }
            | PatchOp::Replace { path, .. }
            | PatchOp::Move { path, .. }
            | PatchOp::Copy { path, .. }
            | PatchOp::Test { path, .. } => path,
        }
    }
}

/// An RFC 6902 JSON Patch: a list of operations applied in order, all or none.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Patch(Vec<PatchOp>);

impl Patch {
    pub fn new() -> Self {
        Self::default()
    }

    /// The operations that turn `old` into `new`.
    pub fn diff(old: &Value, new: &Value) -> Self {
        // Both patch types serialize to RFC 6902, so the conversion cannot fail.
        serde_json::to_value(json_patch::diff(old, new))
            .and_then(serde_json::from_value)
            .unwrap_or_default()
    }

    /// Sets the value at `path`: adds a map entry (replacing an existing one) or
    /// inserts into an array (`-` appends). The parent must exist.
    pub fn add(self, path: impl Into<String>, value: Value) -> Self {
        self.push(PatchOp::Add {
            path: path.into(),
            value,
        })
    }

    /// Removes the value at `path`, which must exist.
    pub fn remove(self, path: impl Into<String>) -> Self {
        self.push(PatchOp::Remove { path: path.into() })
    }

    /// Replaces the value at `path`, which must exist.
    pub fn replace(self, path: impl Into<String>, value: Value) -> Self {
        self.push(PatchOp::Replace {
            path: path.into(),
            value,
        })
    }

    /// Fails the whole patch unless the value at `path` equals `value`.
    pub fn test(self, path: impl Into<String>, value: Value) -> Self {
        self.push(PatchOp::Test {
            path: path.into(),
            value,
        })
    }

    pub fn move_(self, from: impl Into<String>, path: impl Into<String>) -> Self {
        self.push(PatchOp::Move {
            from: from.into(),
            path: path.into(),
        })
    }

    pub fn copy(self, from: impl Into<String>, path: impl Into<String>) -> Self {
        self.push(PatchOp::Copy {
            from: from.into(),
            path: path.into(),
        })
    }

    /// Sets `metadata.labels[key]` of `object`, creating the map when it is missing
    /// (an `add` into a missing map would fail).
    pub fn set_label(self, object: &Value, key: &str, value: &str) -> Self {
        self.set_metadata_entry(object, "labels", key, value)
    }

    /// Sets `metadata.annotations[key]`, like [`set_label`](Self::set_label).
    pub fn set_annotation(self, object: &Value, key: &str, value: &str) -> Self {
        self.set_metadata_entry(object, "annotations", key, value)
    }

    fn set_metadata_entry(self, object: &Value, map: &str, key: &str, value: &str) -> Self {
        let current = object.get("metadata").and_then(|m| m.get(map));
        match current {
            Some(Value::Object(entries))
                if entries.get(key).and_then(Value::as_str) == Some(value) =>
            {
                self
            }
            Some(Value::Object(_)) => self.add(pointer!("metadata", map, key), value.into()),
            _ => self.add(pointer!("metadata", map), serde_json::json!({ key: value })),
        }
    }

    /// Appends an operation.
    pub fn push(mut self, op: PatchOp) -> Self {
        self.0.push(op);
        self
    }

    /// Appends the operations of `other`.
    pub fn extend(mut self, other: Patch) -> Self {
        self.0.extend(other.0);
        self
    }

    pub fn ops(&self) -> &[PatchOp] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The patch as a JSON array, as the host expects it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.0).unwrap_or_else(|_| "[]".into())
    }

    /// `object` with the patch applied, or why it does not apply.
    pub fn apply(&self, object: &Value) -> Result<Value, String> {
        let ops: json_patch::Patch = serde_json::to_value(self)
            .and_then(serde_json::from_value)
            .map_err(|e| format!("patch: {e}"))?;
        let mut out = object.clone();
        json_patch::patch(&mut out, &ops).map_err(|e| e.to_string())?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn pointers_escape_tilde_before_slash() {
        assert_eq!(escape("a/b~c"), "a~1b~0c");
        // `~1` in a key must stay literal: escaping `/` first would turn it into `~01`.
        assert_eq!(escape("~1"), "~01");
        assert_eq!(
            pointer!("metadata", "labels", "app.kubernetes.io/name").as_str(),
            "/metadata/labels/app.kubernetes.io~1name"
        );
        assert_eq!(
            pointer!("spec", "containers", 2).to_string(),
            "/spec/containers/2"
        );
        assert_eq!(Pointer::root().as_str(), "");
    }

    #[test]
    fn serializes_as_rfc6902() {
        let p = Patch::new()
            .add("/a", json!(1))
            .remove("/b")
            .replace("/c", json!("x"))
            .test("/d", json!(null))
            .move_("/e", "/f")
            .copy("/g", "/h");
        let v: Value = serde_json::from_str(&p.to_json()).unwrap();
        assert_eq!(
            v,
            json!([
                {"op": "add", "path": "/a", "value": 1},
                {"op": "remove", "path": "/b"},
                {"op": "replace", "path": "/c", "value": "x"},
                {"op": "test", "path": "/d", "value": null},
                {"op": "move", "from": "/e", "path": "/f"},
                {"op": "copy", "from": "/g", "path": "/h"},
            ])
        );
    }

    #[test]
    fn labels_are_added_with_or_without_a_map() {
        let bare = json!({"metadata": {"name": "x"}});
        let p = Patch::new().set_label(&bare, "a/b", "1");
        assert_eq!(
            p.apply(&bare).unwrap()["metadata"]["labels"],
            json!({"a/b": "1"})
        );

        let labelled = json!({"metadata": {"labels": {"keep": "me"}}});
        let p = Patch::new().set_label(&labelled, "a/b", "1");
        assert_eq!(p.ops()[0].path(), "/metadata/labels/a~1b");
        assert_eq!(
            p.apply(&labelled).unwrap()["metadata"]["labels"],
            json!({"keep": "me", "a/b": "1"})
        );

        let already = json!({"metadata": {"labels": {"a/b": "1"}}});
        assert!(Patch::new().set_label(&already, "a/b", "1").is_empty());
    }

    #[test]
    fn a_failed_test_op_fails_the_whole_patch() {
        let doc = json!({"spec": {"replicas": 1}});
        let p = Patch::new()
            .replace("/spec/replicas", json!(3))
            .test("/spec/paused", json!(true));
        assert!(p.apply(&doc).is_err());
        assert!(Patch::new().remove("/missing").apply(&doc).is_err());
    }

    #[test]
    fn diff_round_trips() {
        let old = json!({"metadata": {"labels": {"a": "1", "x/y": "2"}}, "spec": {"n": [1, 2]}});
        let new =
            json!({"metadata": {"labels": {"a": "9"}}, "spec": {"n": [1, 2, 3]}, "status": {}});
        let p = Patch::diff(&old, &new);
        assert!(!p.is_empty());
        assert_eq!(p.apply(&old).unwrap(), new);
        assert!(Patch::diff(&new, &new).is_empty());
    }
}
