//! Resource quantities (`500m`, `1.5Gi`, `2e3`), exact: parsed into an integer count of
//! nano-units, so that sums and comparisons for limits and quotas never round.
//!
//! The grammar is Kubernetes': an optionally signed decimal number, then a binary
//! suffix (`Ki` … `Ei`), a decimal suffix (`n`, `u`, `m`, none, `k`, `M` … `E`) or a
//! decimal exponent (`e3`, `E-2`). A value finer than a nano-unit is rounded up, as
//! Kubernetes rounds. Written back, a quantity takes a canonical form: the largest
//! suffix that keeps it an integer (`1500m`, `2`, `1Gi`), binary suffixes only for
//! quantities read in binary notation and whole multiples of 1024.

#![forbid(unsafe_code)]

use std::cmp::Ordering;
use std::fmt;

/// Nano-units per unit.
const NANO: i128 = 1_000_000_000;

/// A parse failure, in the words Kubernetes uses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error(
        "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )]
    Format,
    #[error("quantity is too large")]
    TooLarge,
}

/// How a quantity was written, which decides how it is written back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notation {
    /// `Ki`, `Mi`, …
    BinarySi,
    /// `m`, `k`, `M`, … or none.
    DecimalSi,
    /// `e3`, `E-2`.
    DecimalExponent,
}

/// An exact quantity.
#[derive(Clone, Copy, Debug)]
pub struct Quantity {
    nanos: i128,
    notation: Notation,
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}

impl Eq for Quantity {}

impl PartialOrd for Quantity {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Quantity {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

impl Default for Quantity {
    fn default() -> Self {
        Self::ZERO
    }
}

impl Quantity {
    pub const ZERO: Quantity = Quantity {
        nanos: 0,
        notation: Notation::DecimalSi,
    };

    /// A whole number of units (a count of objects).
    pub fn from_units(n: i64) -> Self {
        Self {
            nanos: i128::from(n) * NANO,
            notation: Notation::DecimalSi,
        }
    }

    pub fn parse(s: &str) -> Result<Self, QuantityError> {
        let s = s.trim();
        let number_end = s
            .char_indices()
            .find(|(i, c)| {
                !(c.is_ascii_digit() || *c == '.' || (*i == 0 && matches!(c, '+' | '-')))
            })
            .map_or(s.len(), |(i, _)| i);
        let (number, suffix) = s.split_at(number_end);
        let (negative, digits) = match number.as_bytes().first() {
            Some(b'-') => (true, &number[1..]),
            Some(b'+') => (false, &number[1..]),
            _ => (false, number),
        };
        let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(QuantityError::Format);
        }
        // value = mantissa × 10^(exp10) × 2^(exp2)
        let mut mantissa: i128 = 0;
        for c in whole.chars().chain(fraction.chars()) {
            let d = i128::from(c.to_digit(10).ok_or(QuantityError::Format)?);
            mantissa = mantissa
                .checked_mul(10)
                .and_then(|m| m.checked_add(d))
                .ok_or(QuantityError::TooLarge)?;
        }
        let places = i32::try_from(fraction.len()).map_err(|_| QuantityError::TooLarge)?;
        let (exp10, exp2, notation) = match suffix {
            "Ki" => (0, 10, Notation::BinarySi),
            "Mi" => (0, 20, Notation::BinarySi),
            "Gi" => (0, 30, Notation::BinarySi),
            "Ti" => (0, 40, Notation::BinarySi),
            "Pi" => (0, 50, Notation::BinarySi),
            "Ei" => (0, 60, Notation::BinarySi),
            "n" => (-9, 0, Notation::DecimalSi),
            "u" => (-6, 0, Notation::DecimalSi),
            "m" => (-3, 0, Notation::DecimalSi),
            "" => (0, 0, Notation::DecimalSi),
            "k" => (3, 0, Notation::DecimalSi),
            "M" => (6, 0, Notation::DecimalSi),
            "G" => (9, 0, Notation::DecimalSi),
            "T" => (12, 0, Notation::DecimalSi),
            "P" => (15, 0, Notation::DecimalSi),
            "E" => (18, 0, Notation::DecimalSi),
            _ => {
                let exp = suffix
                    .strip_prefix(['e', 'E'])
                    .ok_or(QuantityError::Format)?;
                let unsigned = exp.strip_prefix(['+', '-']).unwrap_or(exp);
                if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(QuantityError::Format);
                }
                let exp: i32 = exp.parse().map_err(|_| QuantityError::TooLarge)?;
                (exp, 0, Notation::DecimalExponent)
            }
        };
        // In nano-units: × 10^(exp10 + 9 - places) × 2^exp2, rounding up what is finer.
        let scale = exp10 + 9 - places;
        let mut nanos = mantissa
            .checked_mul(1i128 << exp2)
            .ok_or(QuantityError::TooLarge)?;
        if scale >= 0 {
            let factor = 10i128
                .checked_pow(scale.unsigned_abs())
                .ok_or(QuantityError::TooLarge)?;
            nanos = nanos.checked_mul(factor).ok_or(QuantityError::TooLarge)?;
        } else {
            let divisor = 10i128
                .checked_pow(scale.unsigned_abs())
                .unwrap_or(i128::MAX);
            let rounded_up = nanos % divisor != 0;
            nanos = nanos / divisor + i128::from(rounded_up);
        }
        // Beyond 2^63 units, Kubernetes' own quantities stop being exact too.
        if nanos > i128::from(i64::MAX) * NANO {
            return Err(QuantityError::TooLarge);
        }
        Ok(Self {
            nanos: if negative { -nanos } else { nanos },
            notation,
        })
    }

    pub fn is_zero(&self) -> bool {
        self.nanos == 0
    }

    /// The sum, in the notation of `self` (of `other` when `self` is zero).
    pub fn saturating_add(self, other: Quantity) -> Quantity {
        Quantity {
            nanos: self.nanos.saturating_add(other.nanos),
            notation: if self.nanos == 0 {
                other.notation
            } else {
                self.notation
            },
        }
    }

    pub fn saturating_sub(self, other: Quantity) -> Quantity {
        Quantity {
            nanos: self.nanos.saturating_sub(other.nanos),
            notation: self.notation,
        }
    }

    /// In thousandths of a unit, rounded up, as Kubernetes' `MilliValue` (CPU).
    pub fn milli_value(&self) -> i64 {
        let milli = self.nanos.div_euclid(NANO / 1000)
            + i128::from(self.nanos.rem_euclid(NANO / 1000) != 0);
        i64::try_from(milli).unwrap_or(if milli < 0 { i64::MIN } else { i64::MAX })
    }

    /// In whole units, rounded up, as Kubernetes' `Value` (memory, storage, counts).
    pub fn value(&self) -> i64 {
        let units = self.nanos.div_euclid(NANO) + i128::from(self.nanos.rem_euclid(NANO) != 0);
        i64::try_from(units).unwrap_or(if units < 0 { i64::MIN } else { i64::MAX })
    }

    /// `self / other` as a ratio, for limit-to-request ratios.
    pub fn ratio(self, other: Quantity) -> Option<f64> {
        (other.nanos != 0).then(|| self.nanos as f64 / other.nanos as f64)
    }
}

impl std::str::FromStr for Quantity {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.nanos < 0 { "-" } else { "" };
        let n = self.nanos.unsigned_abs();
        if n == 0 {
            return f.write_str("0");
        }
        if self.notation == Notation::BinarySi && n.is_multiple_of(NANO as u128) {
            let units = n / NANO as u128;
            for (shift, suffix) in [
                (60, "Ei"),
                (50, "Pi"),
                (40, "Ti"),
                (30, "Gi"),
                (20, "Mi"),
                (10, "Ki"),
            ] {
                if units.is_multiple_of(1u128 << shift) {
                    return write!(f, "{sign}{}{suffix}", units >> shift);
                }
            }
            return write!(f, "{sign}{units}");
        }
        // Decimal: the largest power of 1000 that keeps the value whole.
        const SUFFIXES: [&str; 10] = ["n", "u", "m", "", "k", "M", "G", "T", "P", "E"];
        let mut value = n;
        let mut index = 0;
        while index + 1 < SUFFIXES.len() && value.is_multiple_of(1000) {
            value /= 1000;
            index += 1;
        }
        write!(f, "{sign}{value}{}", SUFFIXES[index])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn milli_value_and_value_round_up_as_kubernetes() {
        assert_eq!(q("100m").milli_value(), 100);
        assert_eq!(q("1.5").milli_value(), 1500);
        assert_eq!(q("1n").milli_value(), 1);
        assert_eq!(q("1Gi").value(), 1 << 30);
        assert_eq!(q("1500m").value(), 2);
        assert_eq!(q("-1500m").value(), -1);
    }

    #[test]
    fn parses_every_notation_exactly() {
        assert_eq!(q("500m"), q("0.5"));
        assert_eq!(q("1Ki"), q("1024"));
        assert_eq!(q("1.5Gi"), q("1536Mi"));
        assert_eq!(q("2e3"), q("2k"));
        assert_eq!(q("1E-3"), q("1m"));
        assert_eq!(q("+.5"), q("500m"));
        assert_eq!(q("-1"), Quantity::ZERO.saturating_sub(q("1")));
        assert_eq!(q("1n").nanos, 1);
        // Finer than a nano-unit rounds up.
        assert_eq!(q("0.1n").nanos, 1);
        assert!(q("1") > q("999m"));
    }

    #[test]
    fn refuses_what_is_not_a_quantity() {
        for bad in [
            "", "m", "1.2.3", "1Zi", "1e", "1ex", "abc", "1 Gi", "--1", "1KiB",
        ] {
            assert_eq!(Quantity::parse(bad), Err(QuantityError::Format), "{bad}");
        }
        assert_eq!(Quantity::parse("1e400"), Err(QuantityError::TooLarge));
        assert_eq!(
            Quantity::parse("99999999999E"),
            Err(QuantityError::TooLarge)
        );
        assert!(Quantity::parse(&"9".repeat(60)).is_err());
    }

    #[test]
    fn writes_the_canonical_form_of_its_notation() {
        for (input, shown) in [
            ("500m", "500m"),
            ("2000m", "2"),
            ("1.5", "1500m"),
            ("1024Mi", "1Gi"),
            ("1.5Ki", "1536"),
            ("1536Mi", "1536Mi"),
            ("0", "0"),
            ("3k", "3k"),
            ("100", "100"),
            ("-2Gi", "-2Gi"),
        ] {
            assert_eq!(q(input).to_string(), shown, "{input}");
        }
        assert_eq!(q("1").saturating_add(q("500m")).to_string(), "1500m");
        assert_eq!(
            Quantity::ZERO
                .saturating_add(q("512Mi"))
                .saturating_add(q("512Mi"))
                .to_string(),
            "1Gi"
        );
    }

    #[test]
    fn ratios_divide_exactly_enough() {
        assert_eq!(q("2").ratio(q("500m")), Some(4.0));
        assert_eq!(q("1").ratio(Quantity::ZERO), None);
    }
}
