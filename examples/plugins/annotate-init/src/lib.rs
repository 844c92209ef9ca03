//! Annotate on init: an initializer that stamps each new object with the time it
//! was initialized, after the create is stored and before anyone can see it.
//!
//! Configuration (`spec.configuration` of the Plugin object), both optional:
//!
//! ```json
//! {"annotation": "trellis.dev/initialized-at", "overwrite": false}
//! ```
//!
//! The value is the current UTC time in RFC 3339 (`2026-11-22T19:50:00Z`). An
//! object that already carries the annotation keeps it unless `overwrite` is true.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use trellis_plugin::{Initialize, InitializeRequest, Value, log};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AnnotateInit {
    #[serde(default = "default_annotation")]
    annotation: String,
    #[serde(default)]
    overwrite: bool,
}

fn default_annotation() -> String {
    "trellis.dev/initialized-at".into()
}

impl Initialize for AnnotateInit {
    fn check_configuration(&self) -> Result<(), String> {
        let (prefix, name) = self
            .annotation
            .rsplit_once('/')
            .unwrap_or(("", &self.annotation));
        if name.is_empty()
            || name.len() > 63
            || prefix.len() > 253
            || self.annotation.contains(char::is_whitespace)
        {
            return Err(format!(
                "annotation {:?} is not a valid annotation key",
                self.annotation
            ));
        }
        Ok(())
    }

    fn initialize(&self, mut object: Value, req: &InitializeRequest) -> Result<Value, String> {
        let metadata = object
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or("the object has no metadata")?;
        let annotations = metadata
            .entry("annotations")
            .or_insert_with(|| Value::Object(Default::default()))
            .as_object_mut()
            .ok_or("metadata.annotations is not a map")?;
        if annotations.contains_key(&self.annotation) && !self.overwrite {
            return Ok(object);
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| format!("clock: {e}"))?;
        let stamp = rfc3339(now.as_secs());
        log::with_fields(
            log::Level::Debug,
            "initialized",
            &[("kind", &req.kind.kind), ("at", &stamp)],
        );
        annotations.insert(self.annotation.clone(), Value::String(stamp));
        Ok(object)
    }
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian;
/// the days-to-date step is Howard Hinnant's `civil_from_days`).
fn rfc3339(secs: u64) -> String {
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

trellis_plugin::initializer!(AnnotateInit);

#[cfg(test)]
mod tests {
    use trellis_plugin::{json, testing::Harness};

    use super::*;

    fn config_map(annotations: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "a", "uid": "u-1", "annotations": annotations}, "data": {"k": "v"}})
    }

    #[test]
    fn stamps_the_time_and_keeps_the_rest() {
        let out = Harness::new()
            .initialize::<AnnotateInit>(config_map(json!({"keep": "me"})))
            .unwrap();
        let stamp = out["metadata"]["annotations"]["trellis.dev/initialized-at"]
            .as_str()
            .unwrap();
        assert_eq!(stamp.len(), "2026-11-22T19:50:00Z".len(), "{stamp}");
        assert!(stamp.starts_with("20") && stamp.ends_with('Z'), "{stamp}");
        assert_eq!(out["metadata"]["annotations"]["keep"], "me");
        assert_eq!(out["metadata"]["uid"], "u-1");
        assert_eq!(out["data"], json!({"k": "v"}));
    }

    #[test]
    fn keeps_an_existing_stamp_unless_told_to_overwrite() {
        let stamped = config_map(json!({"when": "earlier"}));
        let h = Harness::new().with_configuration(json!({"annotation": "when"}));
        assert_eq!(
            h.initialize::<AnnotateInit>(stamped.clone()).unwrap(),
            stamped
        );
        let h = Harness::new().with_configuration(json!({"annotation": "when", "overwrite": true}));
        assert_ne!(
            h.initialize::<AnnotateInit>(stamped).unwrap()["metadata"]["annotations"]["when"],
            "earlier"
        );
    }

    #[test]
    fn fails_on_objects_it_cannot_annotate() {
        let h = Harness::new();
        assert_eq!(
            h.initialize::<AnnotateInit>(json!({"kind": "X"})),
            Err("the object has no metadata".into())
        );
        let odd = json!({"metadata": {"name": "x", "annotations": []}});
        assert_eq!(
            h.initialize::<AnnotateInit>(odd),
            Err("metadata.annotations is not a map".into())
        );
    }

    #[test]
    fn rejects_bad_annotation_keys() {
        let h = Harness::new().with_configuration(json!({"annotation": "has space"}));
        assert!(h.initializer_configuration::<AnnotateInit>().is_err());
        let h = Harness::new().with_configuration(json!({"annotation": "example.com/"}));
        assert!(h.initializer_configuration::<AnnotateInit>().is_err());
        assert!(
            Harness::new()
                .initializer_configuration::<AnnotateInit>()
                .is_ok()
        );
    }

    #[test]
    fn formats_dates_across_leap_years() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(rfc3339(4_102_444_800), "2100-01-01T00:00:00Z");
    }
}
