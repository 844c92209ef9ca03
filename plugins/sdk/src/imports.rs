//! The guest side of the host's imports: the seam between plugin code and whoever
//! serves the `log` and `cluster` imports.
//!
//! [`log`](crate::log) and [`cluster`](crate::cluster) call whichever [`Host`] is
//! installed on the current thread. In a component, the glue that the export macros
//! generate installs one backed by the WIT imports for the length of each call; in
//! native tests, [`testing`](crate::testing) installs one that records logs and
//! serves a fixture map. With none installed (native code outside the harness), logs
//! go to stderr and cluster reads fail.

use std::{cell::RefCell, fmt, rc::Rc};

use crate::GroupVersionResource;

/// Severity, as the WIT `log.level` enum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Trace => "TRACE",
            Level::Debug => "DEBUG",
            Level::Info => "INFO",
            Level::Warn => "WARN",
            Level::Error => "ERROR",
        })
    }
}

/// What a plugin can ask of the host: the `log` and `cluster` imports of the WIT
/// contract, in plain Rust types.
pub trait Host {
    fn log(&self, level: Level, message: &str, fields: &[(&str, &str)]);

    fn get(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String>;

    fn list(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String>;
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<dyn Host>>> = const { RefCell::new(None) };
}

/// Runs `f` with `host` installed, restoring the previous one afterwards (also when
/// `f` panics, so one failing test does not leak its host into the next).
pub fn with_host<R>(host: Rc<dyn Host>, f: impl FnOnce() -> R) -> R {
    with_installed(&CURRENT, host, f)
}

/// Runs `f` with `value` in the thread-local `slot`, putting back what was there
/// afterwards, also when `f` panics.
pub(crate) fn with_installed<T: ?Sized + 'static, R>(
    slot: &'static std::thread::LocalKey<RefCell<Option<Rc<T>>>>,
    value: Rc<T>,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: ?Sized + 'static> {
        slot: &'static std::thread::LocalKey<RefCell<Option<Rc<T>>>>,
        previous: Option<Rc<T>>,
    }
    impl<T: ?Sized + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            let previous = self.previous.take();
            self.slot.with(|c| *c.borrow_mut() = previous);
        }
    }
    let previous = slot.with(|c| c.borrow_mut().replace(value));
    let _restore = Restore { slot, previous };
    f()
}

/// The installed host, or the stderr fallback.
pub(crate) fn current() -> Rc<dyn Host> {
    CURRENT
        .with(|c| c.borrow().clone())
        .unwrap_or_else(|| Rc::new(Stderr))
}

/// Used when nothing is installed: native code run outside the test harness.
struct Stderr;

impl Host for Stderr {
    fn log(&self, level: Level, message: &str, fields: &[(&str, &str)]) {
        eprintln!("{}", format_record(level, message, fields));
    }

    fn get(
        &self,
        _: &GroupVersionResource,
        _: Option<&str>,
        _: &str,
    ) -> Result<Option<String>, String> {
        Err(NO_CLUSTER.into())
    }

    fn list(
        &self,
        _: &GroupVersionResource,
        _: Option<&str>,
        _: &str,
    ) -> Result<Vec<String>, String> {
        Err(NO_CLUSTER.into())
    }
}

const NO_CLUSTER: &str = "no cluster outside a Trellis host or the test harness";

/// One line: `INFO message key=value ...`, as the stderr fallback and the harness
/// print it.
pub(crate) fn format_record(level: Level, message: &str, fields: &[(&str, &str)]) -> String {
    let mut line = format!("{level} {message}");
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v:?}"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Named(&'static str);

    impl Host for Named {
        fn log(&self, _: Level, _: &str, _: &[(&str, &str)]) {}
        fn get(
            &self,
            _: &GroupVersionResource,
            _: Option<&str>,
            _: &str,
        ) -> Result<Option<String>, String> {
            Ok(Some(self.0.into()))
        }
        fn list(
            &self,
            _: &GroupVersionResource,
            _: Option<&str>,
            _: &str,
        ) -> Result<Vec<String>, String> {
            Ok(vec![])
        }
    }

    fn who() -> Result<Option<String>, String> {
        current().get(&GroupVersionResource::new("", "v1", "pods"), None, "x")
    }

    #[test]
    fn nested_hosts_are_restored_in_order() {
        assert!(who().is_err(), "no host installed: cluster reads fail");
        with_host(Rc::new(Named("outer")), || {
            assert_eq!(who().unwrap().as_deref(), Some("outer"));
            with_host(Rc::new(Named("inner")), || {
                assert_eq!(who().unwrap().as_deref(), Some("inner"));
            });
            assert_eq!(who().unwrap().as_deref(), Some("outer"));
        });
        assert!(who().is_err());
    }

    #[test]
    fn a_panic_does_not_leak_the_host() {
        let caught = std::panic::catch_unwind(|| {
            with_host(Rc::new(Named("leaky")), || panic!("plugin bug"));
        });
        assert!(caught.is_err());
        assert!(who().is_err(), "the host was removed while unwinding");
    }

    #[test]
    fn records_print_fields_quoted() {
        assert_eq!(
            format_record(Level::Warn, "denied", &[("image", "a b"), ("n", "1")]),
            r#"WARN denied image="a b" n="1""#
        );
    }
}
