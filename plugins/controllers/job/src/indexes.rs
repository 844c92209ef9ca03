//! An Indexed Job's `status.completedIndexes`: a set of indexes written as
//! Kubernetes writes it, ascending intervals `0,2-4,7`.

use std::collections::BTreeSet;

/// The indexes `s` lists, those below `completions` only (what the API server
/// keeps after a change of completions).
pub fn parse(s: &str, completions: u64) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (from, to) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u64>(), b.parse::<u64>()),
            None => (part.parse(), part.parse()),
        };
        if let (Ok(from), Ok(to)) = (from, to) {
            set.extend((from..=to.min(completions.saturating_sub(1))).take(1 << 20));
        }
    }
    set
}

/// The interval form of `set`.
pub fn format(set: &BTreeSet<u64>) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut iter = set.iter().copied().peekable();
    while let Some(start) = iter.next() {
        let mut end = start;
        while iter.peek() == Some(&(end + 1)) {
            end += 1;
            iter.next();
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_round_trip_through_intervals() {
        let set = parse("0,2-4,7", 10);
        assert_eq!(set.iter().copied().collect::<Vec<_>>(), [0, 2, 3, 4, 7]);
        assert_eq!(format(&set), "0,2-4,7");
        assert_eq!(format(&parse("1-9", 3)), "1-2");
        assert_eq!(format(&BTreeSet::new()), "");
    }
}
