//! Cron schedules as Kubernetes reads them (robfig/cron's standard parser): five
//! fields (minute, hour, day of month, month, day of week) of `*`, `?`, numbers,
//! names (`JAN`, `MON`), ranges, lists and steps, or a descriptor (`@yearly`,
//! `@annually`, `@monthly`, `@weekly`, `@daily`, `@midnight`, `@hourly`); times in
//! a time zone of the IANA database. When both day fields are restricted a day
//! matching either runs, as cron does.

use jiff::civil::{Date, DateTime};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

/// A parsed schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    /// Either day field is `*` or `?`: a day must match both.
    day_star: bool,
}

struct Field {
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

const MINUTES: Field = Field {
    min: 0,
    max: 59,
    names: &[],
};
const HOURS: Field = Field {
    min: 0,
    max: 23,
    names: &[],
};
const DAYS: Field = Field {
    min: 1,
    max: 31,
    names: &[],
};
const MONTHS: Field = Field {
    min: 1,
    max: 12,
    names: &[
        "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
    ],
};
const WEEKDAYS: Field = Field {
    min: 0,
    max: 6,
    names: &["sun", "mon", "tue", "wed", "thu", "fri", "sat"],
};

/// A field's bits, and whether it was `*`/`?` (step 1).
fn parse_field(expr: &str, field: &Field) -> Result<(u64, bool), String> {
    let mut bits = 0u64;
    let mut star = false;
    for part in expr.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (
                r,
                Some(
                    s.parse::<u32>()
                        .map_err(|_| format!("bad step {s:?} in {part:?}"))?,
                ),
            ),
            None => (part, None),
        };
        let number = |s: &str| -> Result<u32, String> {
            if let Some(i) = field.names.iter().position(|n| n.eq_ignore_ascii_case(s)) {
                return Ok(field.min + i as u32);
            }
            s.parse::<u32>()
                .map_err(|_| format!("failed to parse int from {s}"))
        };
        let (start, mut end, is_star) = if range == "*" || range == "?" {
            (field.min, field.max, true)
        } else if let Some((a, b)) = range.split_once('-') {
            (number(a)?, number(b)?, false)
        } else {
            let n = number(range)?;
            (n, n, false)
        };
        if let Some(step) = step {
            if step == 0 {
                return Err(format!("step of range should be a positive number: {part}"));
            }
            // `N/step` is `N-max/step`.
            if !is_star && !range.contains('-') {
                end = field.max;
            }
        }
        if start < field.min || end > field.max || start > end {
            return Err(format!(
                "{part:?}: beyond the range {}-{}",
                field.min, field.max
            ));
        }
        let step = step.unwrap_or(1);
        star |= is_star && step == 1;
        let mut i = start;
        while i <= end {
            bits |= 1 << i;
            i += step;
        }
    }
    Ok((bits, star))
}

impl Schedule {
    pub fn parse(spec: &str) -> Result<Schedule, String> {
        let spec = spec.trim();
        let expanded = match spec {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            s if s.starts_with('@') => return Err(format!("unrecognized descriptor: {s}")),
            s => s,
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        if fields.len() != 5 {
            return Err(format!(
                "expected exactly 5 fields, found {}: {spec}",
                fields.len()
            ));
        }
        let (minutes, _) = parse_field(fields[0], &MINUTES)?;
        let (hours, _) = parse_field(fields[1], &HOURS)?;
        let (days, dom_star) = parse_field(fields[2], &DAYS)?;
        let (months, _) = parse_field(fields[3], &MONTHS)?;
        // Sunday is 0, and 7 too.
        let weekdays_field = Field { max: 7, ..WEEKDAYS };
        let (mut weekdays, dow_star) = parse_field(fields[4], &weekdays_field)?;
        if weekdays & (1 << 7) != 0 {
            weekdays = (weekdays | 1) & !(1 << 7);
        }
        Ok(Schedule {
            minutes,
            hours,
            days,
            months,
            weekdays,
            day_star: dom_star || dow_star,
        })
    }

    fn day_matches(&self, date: Date) -> bool {
        let dom = self.days & (1 << date.day()) != 0;
        let dow = self.weekdays & (1 << date.weekday().to_sunday_zero_offset()) != 0;
        if self.day_star {
            dom && dow
        } else {
            dom || dow
        }
    }

    /// The first time after `after` (strictly) the schedule fires in `tz`; `None`
    /// when it never does within five years (`0 0 30 2 *`).
    pub fn next(&self, after: Timestamp, tz: &TimeZone) -> Option<Timestamp> {
        let local = after.to_zoned(tz.clone()).datetime();
        let mut date = local.date();
        // On the first day, what is before `after`'s wall-clock minute is passed by.
        let mut from = (local.hour(), local.minute());
        for _ in 0..(366 * 5) {
            if self.months & (1 << date.month()) != 0 && self.day_matches(date) {
                for hour in (from.0..24).filter(|h| self.hours & (1 << h) != 0) {
                    let first = if hour == from.0 { from.1 } else { 0 };
                    for minute in (first..60).filter(|m| self.minutes & (1 << m) != 0) {
                        let at = DateTime::new(
                            date.year(),
                            date.month(),
                            date.day(),
                            hour,
                            minute,
                            0,
                            0,
                        )
                        .ok()?;
                        // A wall time a DST gap skips runs at the gap's end;
                        // one a fold repeats runs once, the first time.
                        let Ok(zoned) = at.to_zoned(tz.clone()) else {
                            continue;
                        };
                        if zoned.timestamp() > after {
                            return Some(zoned.timestamp());
                        }
                    }
                }
            }
            date = date.checked_add(1.day()).ok()?;
            from = (0, 0);
        }
        None
    }

    /// The latest time in `(earliest, now]` the schedule fired, and how many
    /// times it fired then (counted up to 101: more is "too many").
    pub fn most_recent(
        &self,
        earliest: Timestamp,
        now: Timestamp,
        tz: &TimeZone,
    ) -> Option<(Timestamp, usize)> {
        let first = self.next(earliest, tz)?;
        if first > now {
            return None;
        }
        let (mut last, mut count) = (first, 1);
        while count <= 100 {
            match self.next(last, tz) {
                Some(t) if t <= now => {
                    last = t;
                    count += 1;
                }
                _ => return Some((last, count)),
            }
        }
        // Too many to walk: the latest is found from windows before now that grow
        // until one holds a time.
        let mut window = 1.day();
        for _ in 0..12 {
            let from = now
                .checked_sub(window)
                .ok()
                .map_or(earliest, |f| f.max(earliest));
            if let Some(mut t) = self.next(from, tz).filter(|t| *t <= now) {
                while let Some(n) = self.next(t, tz).filter(|n| *n <= now) {
                    t = n;
                }
                return Some((t, count));
            }
            window = window.checked_mul(2).ok()?;
        }
        Some((last, count))
    }
}

/// The time zone a CronJob names (`spec.timeZone`), UTC when it names none.
pub fn time_zone(name: Option<&str>) -> Result<TimeZone, String> {
    match name {
        None | Some("") => Ok(TimeZone::UTC),
        Some(name) => TimeZone::get(name).map_err(|e| format!("unknown time zone {name}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn next(spec: &str, after: &str, tz: &str) -> String {
        Schedule::parse(spec)
            .unwrap()
            .next(at(after), &time_zone(Some(tz)).unwrap())
            .unwrap()
            .to_string()
    }

    #[test]
    fn fields_ranges_steps_names_and_descriptors() {
        assert_eq!(
            next("*/15 * * * *", "2026-01-01T00:07:00Z", "UTC"),
            "2026-01-01T00:15:00Z"
        );
        assert_eq!(
            next("5 4 * * *", "2026-01-01T04:05:00Z", "UTC"),
            "2026-01-02T04:05:00Z"
        );
        assert_eq!(
            next("0 9-17/4 * * MON-FRI", "2026-01-02T13:00:00Z", "UTC"),
            "2026-01-02T17:00:00Z"
        );
        // 2026-01-03 is a Saturday: to Monday.
        assert_eq!(
            next("0 9 * * 1-5", "2026-01-02T10:00:00Z", "UTC"),
            "2026-01-05T09:00:00Z"
        );
        assert_eq!(
            next("@monthly", "2026-01-15T00:00:00Z", "UTC"),
            "2026-02-01T00:00:00Z"
        );
        assert_eq!(
            next("@hourly", "2026-01-15T00:00:00Z", "UTC"),
            "2026-01-15T01:00:00Z"
        );
        assert_eq!(
            next("0 0 29 2 *", "2026-03-01T00:00:00Z", "UTC"),
            "2028-02-29T00:00:00Z"
        );
        assert_eq!(
            next("0 0 * * 7", "2026-01-01T00:00:00Z", "UTC"),
            "2026-01-04T00:00:00Z"
        );
        // Both day fields restricted: either day.
        assert_eq!(
            next("0 0 13 * 5", "2026-01-01T00:00:00Z", "UTC"),
            "2026-01-02T00:00:00Z"
        );
        assert_eq!(
            next("30 2 1 jan,jul ?", "2026-02-01T00:00:00Z", "UTC"),
            "2026-07-01T02:30:00Z"
        );
        for bad in [
            "* * * *",
            "61 * * * *",
            "* * * * * *",
            "*/0 * * * *",
            "@every 1h",
            "a * * * *",
        ] {
            assert!(Schedule::parse(bad).is_err(), "{bad}");
        }
        assert!(
            Schedule::parse("0 0 30 2 *")
                .unwrap()
                .next(at("2026-01-01T00:00:00Z"), &TimeZone::UTC)
                .is_none()
        );
    }

    #[test]
    fn a_time_zone_moves_the_wall_clock_time() {
        // 09:00 in New York in winter is 14:00 UTC, in summer 13:00 UTC.
        assert_eq!(
            next("0 9 * * *", "2026-01-10T00:00:00Z", "America/New_York"),
            "2026-01-10T14:00:00Z"
        );
        assert_eq!(
            next("0 9 * * *", "2026-07-10T00:00:00Z", "America/New_York"),
            "2026-07-10T13:00:00Z"
        );
        assert!(time_zone(Some("Mars/Olympus")).is_err());
    }

    #[test]
    fn the_most_recent_missed_time_and_how_many_were_missed() {
        let s = Schedule::parse("* * * * *").unwrap();
        let (t, n) = s
            .most_recent(
                at("2026-01-01T00:00:30Z"),
                at("2026-01-01T00:10:10Z"),
                &TimeZone::UTC,
            )
            .unwrap();
        assert_eq!((t.to_string().as_str(), n), ("2026-01-01T00:10:00Z", 10));
        let (t, n) = s
            .most_recent(
                at("2025-12-01T00:00:00Z"),
                at("2026-01-01T00:10:10Z"),
                &TimeZone::UTC,
            )
            .unwrap();
        assert_eq!(t.to_string(), "2026-01-01T00:10:00Z");
        assert!(n > 100);
        assert!(
            s.most_recent(
                at("2026-01-01T00:10:00Z"),
                at("2026-01-01T00:10:59Z"),
                &TimeZone::UTC
            )
            .is_none()
        );
    }
}
