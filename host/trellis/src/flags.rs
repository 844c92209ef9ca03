//! Parsers the subcommands' flags share.

use std::time::Duration;

/// A duration in seconds, fractions allowed (`0.5`), as the flags that shorten the
/// product's delays for tests take it.
pub fn seconds(s: &str) -> Result<Duration, String> {
    let value: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    Duration::try_from_secs_f64(value).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_take_fractions_and_refuse_what_is_not_a_duration() {
        assert_eq!(seconds("0.25"), Ok(Duration::from_millis(250)));
        assert_eq!(seconds("3"), Ok(Duration::from_secs(3)));
        assert!(seconds("-1").is_err());
        assert!(seconds("soon").is_err());
    }
}
