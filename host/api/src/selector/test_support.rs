//! Helpers the selector tests share.

use std::collections::BTreeMap;

use super::{LabelOp, LabelSelector};

pub(super) fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

pub(super) fn parse(s: &str) -> LabelSelector {
    LabelSelector::parse(s).unwrap_or_else(|e| panic!("parse {s:?}: {e}"))
}

pub(super) fn parse_err(s: &str) -> String {
    match LabelSelector::parse(s) {
        Ok(sel) => panic!("{s:?} parsed as {sel:?}, expected an error"),
        Err(e) => e.to_string(),
    }
}

pub(super) fn only(sel: &LabelSelector) -> (&str, LabelOp, Vec<&str>) {
    assert_eq!(sel.requirements().len(), 1, "{sel:?}");
    let r = &sel.requirements()[0];
    (
        r.key(),
        r.operator(),
        r.values().iter().map(String::as_str).collect(),
    )
}
