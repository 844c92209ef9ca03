//! The three kinds of plugin, and the generic code behind the export macros.
//!
//! A plugin type is its own configuration: it derives `Deserialize`, and the host's
//! `spec.configuration` is decoded into it (and checked with
//! `check_configuration`) when the plugin loads. Everything here is plain Rust, so
//! the [`testing`](crate::testing) harness runs the same path as a component does.

use std::{any::Any, cell::RefCell, rc::Rc};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{InitializeRequest, Patch, Request, Status, Verdict};

/// A validating admission plugin: allows or denies, never changes the object.
pub trait Validate: DeserializeOwned + 'static {
    /// Checks beyond what decoding the configuration already checks; an `Err` keeps
    /// the last good version serving and is shown in the Plugin's status.
    fn check_configuration(&self) -> Result<(), String> {
        Ok(())
    }

    /// Judges one request. `Err(status)` denies with that status, so `?` works on
    /// [`Request::object_as`].
    fn validate(&self, req: &Request) -> Result<Verdict, Status>;
}

/// A mutating admission plugin: returns a JSON Patch for the object, or nothing.
pub trait Mutate: DeserializeOwned + 'static {
    /// See [`Validate::check_configuration`].
    fn check_configuration(&self) -> Result<(), String> {
        Ok(())
    }

    /// `Ok(None)` (or an empty patch) leaves the object as it is; `Err` denies.
    fn mutate(&self, req: &Request) -> Result<Option<Patch>, Status>;
}

/// An initializer: runs after a create is stored, before the object is visible,
/// and returns the object to store in its place.
pub trait Initialize: DeserializeOwned + 'static {
    /// See [`Validate::check_configuration`].
    fn check_configuration(&self) -> Result<(), String> {
        Ok(())
    }

    /// The initialized object, or why it cannot be initialized (the create then
    /// fails with that message). Name, namespace and uid must not change.
    fn initialize(&self, object: Value, req: &InitializeRequest) -> Result<Value, String>;
}

/// What an admission plugin hands back to the host, before conversion to WIT.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AdmissionResponse {
    pub allowed: bool,
    pub status: Option<Status>,
    pub warnings: Vec<String>,
    pub patch: Option<String>,
}

thread_local! {
    // The last configuration decoded, keyed by its text: the host passes the same
    // text with every request, and decoding it each time would be wasted work.
    static CONFIG: RefCell<Option<(String, Rc<dyn Any>)>> = const { RefCell::new(None) };
}

/// Decodes (or reuses) the configuration and runs `check` on a fresh decode.
pub(crate) fn configure<T: DeserializeOwned + 'static>(
    text: &str,
    check: fn(&T) -> Result<(), String>,
) -> Result<Rc<T>, String> {
    let text = if text.trim().is_empty() { "{}" } else { text };
    let cached = CONFIG.with(|c| match &*c.borrow() {
        Some((t, v)) if t == text => v.clone().downcast::<T>().ok(),
        _ => None,
    });
    if let Some(config) = cached {
        return Ok(config);
    }
    let config: T = serde_json::from_str(text).map_err(|e| format!("configuration: {e}"))?;
    check(&config).map_err(|e| format!("configuration: {e}"))?;
    let config = Rc::new(config);
    CONFIG.with(|c| *c.borrow_mut() = Some((text.to_owned(), config.clone() as Rc<dyn Any>)));
    Ok(config)
}

pub(crate) fn deny(status: Status, warnings: Vec<String>) -> AdmissionResponse {
    AdmissionResponse {
        allowed: false,
        status: Some(status),
        warnings,
        patch: None,
    }
}

pub(crate) fn admit_validating<T: Validate>(
    req: &Request,
    configuration: &str,
) -> AdmissionResponse {
    let plugin = match configure::<T>(configuration, T::check_configuration) {
        Ok(p) => p,
        Err(e) => return deny(Status::internal(e), Vec::new()),
    };
    match plugin.validate(req) {
        Ok(Verdict {
            denial: None,
            warnings,
        }) => AdmissionResponse {
            allowed: true,
            status: None,
            warnings,
            patch: None,
        },
        Ok(Verdict {
            denial: Some(status),
            warnings,
        }) => deny(status, warnings),
        Err(status) => deny(status, Vec::new()),
    }
}

pub(crate) fn admit_mutating<T: Mutate>(req: &Request, configuration: &str) -> AdmissionResponse {
    let plugin = match configure::<T>(configuration, T::check_configuration) {
        Ok(p) => p,
        Err(e) => return deny(Status::internal(e), Vec::new()),
    };
    match plugin.mutate(req) {
        Ok(patch) => AdmissionResponse {
            allowed: true,
            status: None,
            warnings: Vec::new(),
            patch: patch.filter(|p| !p.is_empty()).map(|p| p.to_json()),
        },
        Err(status) => deny(status, Vec::new()),
    }
}

pub(crate) fn initialize<T: Initialize>(
    req: &InitializeRequest,
    object: &str,
    configuration: &str,
) -> Result<String, String> {
    let plugin = configure::<T>(configuration, T::check_configuration)?;
    let object: Value = serde_json::from_str(object).map_err(|e| format!("object: {e}"))?;
    let out = plugin.initialize(object, req)?;
    serde_json::to_string(&out).map_err(|e| format!("encode the object: {e}"))
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use serde::Deserialize;

    use super::*;

    thread_local!(static DECODES: Cell<u32> = const { Cell::new(0) });

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Counted {
        #[serde(default, deserialize_with = "count")]
        n: u32,
    }

    fn count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        DECODES.with(|c| c.set(c.get() + 1));
        u32::deserialize(d)
    }

    fn positive(c: &Counted) -> Result<(), String> {
        if c.n == 0 {
            Err("n must be positive".into())
        } else {
            Ok(())
        }
    }

    #[test]
    fn configuration_is_decoded_once_per_text_and_checked() {
        assert_eq!(configure::<Counted>(r#"{"n": 2}"#, positive).unwrap().n, 2);
        assert_eq!(configure::<Counted>(r#"{"n": 2}"#, positive).unwrap().n, 2);
        assert_eq!(
            DECODES.with(Cell::get),
            1,
            "the second call reused the first decode"
        );
        assert_eq!(configure::<Counted>(r#"{"n": 3}"#, positive).unwrap().n, 3);
        assert_eq!(DECODES.with(Cell::get), 2);

        let err = configure::<Counted>(r#"{"n": 0}"#, positive).err().unwrap();
        assert_eq!(err, "configuration: n must be positive");
        let err = configure::<Counted>(r#"{"m": 1}"#, positive).err().unwrap();
        assert!(err.starts_with("configuration: unknown field `m`"), "{err}");
    }

    #[test]
    fn an_empty_configuration_reads_as_an_empty_object() {
        #[derive(Deserialize)]
        struct Empty {}
        assert!(configure::<Empty>("", |_| Ok(())).is_ok());
        assert!(configure::<Empty>("{}", |_| Ok(())).is_ok());
    }
}
