//! A process as `/proc` shows it: what tells a live process from a reused pid.

/// The start time /proc gives process `pid`, if it is alive (a zombie is not).
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow its last ')'.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    if matches!(fields.first(), Some(&"Z" | &"X" | &"x")) {
        return None;
    }
    // Field 22 of stat(5), the 20th after the name.
    fields.get(19)?.parse().ok()
}
