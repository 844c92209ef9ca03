//! The Pod Security Standards as Kubernetes' `k8s.io/pod-security-admission/policy`
//! states them: each check, its level, the policy versions it applies from, and its
//! message word for word, so that a refusal reads as kube-apiserver's.
//!
//! Checks run in Kubernetes' order: the baseline checks every level above privileged
//! runs, then either the baseline checks that a restricted check supersedes (at
//! baseline) or the restricted checks (at restricted). A pod is read as JSON: the
//! checks look at its metadata and spec only.

use std::collections::BTreeSet;
use std::fmt;

use serde_json::Value;

/// The newest policy version whose checks this server knows; `latest`, and any newer
/// `v1.x`, are evaluated as this one.
pub const LATEST_MINOR: u32 = 34;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Level {
    Privileged,
    Baseline,
    Restricted,
}

impl Level {
    /// Parses a label or configuration value. Kubernetes evaluates an unknown level as
    /// `restricted` and reports the error.
    pub fn parse(s: &str) -> Result<Level, String> {
        match s {
            "privileged" => Ok(Level::Privileged),
            "baseline" => Ok(Level::Baseline),
            "restricted" => Ok(Level::Restricted),
            _ => Err("must be one of privileged, baseline, restricted".into()),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Level::Privileged => "privileged",
            Level::Baseline => "baseline",
            Level::Restricted => "restricted",
        }
    }
}

/// A policy version: `latest` or `v1.MINOR`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Version {
    Latest,
    V1(u32),
}

impl Version {
    /// Parses a label or configuration value; an invalid one is evaluated as `latest`.
    pub fn parse(s: &str) -> Result<Version, String> {
        if s == "latest" {
            return Ok(Version::Latest);
        }
        let invalid = || "must be \"latest\" or \"v1.x\"".to_owned();
        let minor = s.strip_prefix("v1.").ok_or_else(invalid)?;
        // Kubernetes' `^v1\.([0-9]|[1-9][0-9]*)$`: no sign, no leading zero.
        if minor.is_empty()
            || !minor.bytes().all(|b| b.is_ascii_digit())
            || (minor.len() > 1 && minor.starts_with('0'))
        {
            return Err(invalid());
        }
        minor.parse().map(Version::V1).map_err(|_| invalid())
    }

    /// The minor version whose checks apply.
    fn minor(self) -> u32 {
        match self {
            Version::Latest => LATEST_MINOR,
            Version::V1(m) => m.min(LATEST_MINOR),
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Version::Latest => f.write_str("latest"),
            Version::V1(m) => write!(f, "v1.{m}"),
        }
    }
}

/// A level at a version, written `baseline:latest` as in Kubernetes' messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LevelVersion {
    pub level: Level,
    pub version: Version,
}

impl LevelVersion {
    pub const fn new(level: Level, version: Version) -> Self {
        Self { level, version }
    }
}

impl fmt::Display for LevelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.level.as_str(), self.version)
    }
}

/// One check's refusal: the short reason and the detail (may be empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forbidden {
    pub reason: String,
    pub detail: String,
}

/// The refusals of every check a pod failed, in check order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Evaluation {
    pub forbidden: Vec<Forbidden>,
}

impl Evaluation {
    pub fn allowed(&self) -> bool {
        self.forbidden.is_empty()
    }

    /// `host namespaces, privileged`: what a namespace's existing pods are warned with.
    pub fn reasons(&self) -> String {
        self.forbidden
            .iter()
            .map(|f| f.reason.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `host namespaces (hostNetwork=true), privileged (container "x" must not set
    /// securityContext.privileged=true)`: what a refusal or warning says.
    pub fn details(&self) -> String {
        self.forbidden
            .iter()
            .map(|f| {
                if f.detail.is_empty() {
                    f.reason.clone()
                } else {
                    format!("{} ({})", f.reason, f.detail)
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Evaluates a pod (its `metadata` and `spec`) against `lv`.
pub fn evaluate(lv: LevelVersion, metadata: &Value, spec: &Value) -> Evaluation {
    let minor = lv.version.minor();
    let pod = Pod { metadata, spec };
    type Check = fn(&Pod, u32) -> Option<Forbidden>;
    // Kubernetes' registration order (its check files, alphabetically).
    const BASELINE: &[Check] = &[
        app_armor_profile,
        host_namespaces,
        host_ports,
        host_probes_and_host_lifecycle,
        privileged,
        proc_mount,
        se_linux_options,
        sysctls,
        windows_host_process,
    ];
    // Baseline checks a restricted one supersedes: run at baseline only (and at
    // restricted for versions older than the check that supersedes them).
    const OVERLAPPING: &[Check] = &[capabilities_baseline, host_path_volumes, seccomp_baseline];
    const RESTRICTED: &[Check] = &[
        allow_privilege_escalation,
        capabilities_restricted,
        restricted_volumes,
        run_as_non_root,
        run_as_user,
        seccomp_restricted,
    ];
    let mut checks: Vec<Check> = Vec::new();
    match lv.level {
        Level::Privileged => return Evaluation::default(),
        Level::Baseline => {
            checks.extend(BASELINE);
            checks.extend(OVERLAPPING);
        }
        Level::Restricted => {
            checks.extend(BASELINE);
            if minor < 22 {
                checks.push(capabilities_baseline);
            }
            if minor < 19 {
                checks.push(seccomp_baseline);
            }
            checks.extend(RESTRICTED);
        }
    }
    Evaluation {
        forbidden: checks
            .iter()
            .filter_map(|check| check(&pod, minor))
            .collect(),
    }
}

struct Pod<'a> {
    metadata: &'a Value,
    spec: &'a Value,
}

impl Pod<'_> {
    /// Init containers, containers, then ephemeral containers, as Kubernetes visits them.
    fn containers(&self) -> impl Iterator<Item = &Value> {
        ["initContainers", "containers", "ephemeralContainers"]
            .into_iter()
            .filter_map(|k| self.spec.get(k).and_then(Value::as_array))
            .flatten()
    }

    fn security_context(&self) -> Option<&Value> {
        self.spec.get("securityContext")
    }

    fn annotations(&self) -> impl Iterator<Item = (&String, &str)> {
        self.metadata
            .get("annotations")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| v.as_str().map(|v| (k, v)))
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        self.metadata
            .get("annotations")
            .and_then(|a| a.get(key))
            .and_then(Value::as_str)
    }

    fn flag(&self, key: &str) -> bool {
        self.spec.get(key).and_then(Value::as_bool) == Some(true)
    }

    fn windows(&self) -> bool {
        self.spec
            .get("os")
            .and_then(|o| o.get("name"))
            .and_then(Value::as_str)
            == Some("windows")
    }

    /// `spec.hostUsers: false`: the pod runs in a user namespace of its own.
    fn own_user_namespace(&self) -> bool {
        self.spec.get("hostUsers").and_then(Value::as_bool) == Some(false)
    }
}

fn name(c: &Value) -> String {
    c.get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

fn context_field<'a>(c: &'a Value, field: &str) -> Option<&'a Value> {
    c.get("securityContext").and_then(|s| s.get(field))
}

fn join_quote<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> String {
    items
        .into_iter()
        .map(|s| format!("\"{}\"", s.as_ref()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn pluralize<'a>(singular: &'a str, plural: &'a str, count: usize) -> &'a str {
    if count == 1 { singular } else { plural }
}

/// `container "a"` / `containers "a", "b"`.
fn containers_phrase(names: &[String]) -> String {
    format!(
        "{} {}",
        pluralize("container", "containers", names.len()),
        join_quote(names)
    )
}

/// Who sets what `sets` finds in a security context: `pod` (its own), then
/// `containers "a", "b"` (theirs), as Kubernetes' messages name them.
fn setters_of(pod: &Pod, sets: impl Fn(Option<&Value>) -> bool) -> Vec<String> {
    let mut setters = Vec::new();
    if sets(pod.security_context()) {
        setters.push("pod".to_owned());
    }
    let bad: Vec<String> = pod
        .containers()
        .filter(|c| sets(c.get("securityContext")))
        .map(name)
        .collect();
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    setters
}

fn forbidden(reason: impl Into<String>, detail: impl Into<String>) -> Option<Forbidden> {
    Some(Forbidden {
        reason: reason.into(),
        detail: detail.into(),
    })
}

// ---- baseline ----

fn app_armor_profile(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    let allowed_type = |v: &Value| {
        matches!(
            v.get("type").and_then(Value::as_str),
            Some("RuntimeDefault" | "Localhost")
        )
    };
    let mut setters = Vec::new();
    let mut values = BTreeSet::new();
    if let Some(profile) = pod
        .security_context()
        .and_then(|s| s.get("appArmorProfile"))
        && !allowed_type(profile)
    {
        setters.push("pod".to_owned());
        values.insert(profile_type(profile));
    }
    let mut bad = Vec::new();
    for c in pod.containers() {
        if let Some(profile) = context_field(c, "appArmorProfile")
            && !allowed_type(profile)
        {
            bad.push(name(c));
            values.insert(profile_type(profile));
        }
    }
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    let mut values: Vec<String> = values.into_iter().collect();
    let mut annotations: Vec<String> = pod
        .annotations()
        .filter(|(k, v)| {
            k.starts_with("container.apparmor.security.beta.kubernetes.io/")
                && !(v.is_empty() || *v == "runtime/default" || v.starts_with("localhost/"))
        })
        .map(|(k, v)| format!("{k}={}", Value::String(v.to_owned())))
        .collect();
    annotations.sort();
    if !annotations.is_empty() {
        setters.push(pluralize("annotation", "annotations", annotations.len()).to_owned());
        values.extend(annotations);
    }
    if setters.is_empty() {
        return None;
    }
    forbidden(
        pluralize(
            "forbidden AppArmor profile",
            "forbidden AppArmor profiles",
            values.len(),
        ),
        format!(
            "{} must not set AppArmor profile type to {}",
            setters.join(" and "),
            join_quote(&values)
        ),
    )
}

fn profile_type(profile: &Value) -> String {
    profile
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

fn host_namespaces(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    let set: Vec<String> = ["hostNetwork", "hostPID", "hostIPC"]
        .into_iter()
        .filter(|k| pod.flag(k))
        .map(|k| format!("{k}=true"))
        .collect();
    if set.is_empty() {
        return None;
    }
    forbidden("host namespaces", set.join(", "))
}

fn host_ports(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    let mut bad = Vec::new();
    let mut ports = BTreeSet::new();
    for c in pod.containers() {
        let mut valid = true;
        for p in c
            .get("ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let host_port = p.get("hostPort").and_then(Value::as_i64).unwrap_or(0);
            if host_port != 0 {
                valid = false;
                // Kubernetes sorts them as strings.
                ports.insert(host_port.to_string());
            }
        }
        if !valid {
            bad.push(name(c));
        }
    }
    if bad.is_empty() {
        return None;
    }
    forbidden(
        "hostPort",
        format!(
            "{} {} {} {}",
            containers_phrase(&bad),
            pluralize("uses", "use", bad.len()),
            pluralize("hostPort", "hostPorts", ports.len()),
            ports.into_iter().collect::<Vec<_>>().join(", ")
        ),
    )
}

fn host_probes_and_host_lifecycle(pod: &Pod, minor: u32) -> Option<Forbidden> {
    if minor < 34 {
        return None;
    }
    let hosts = |handler: Option<&Value>| -> Vec<String> {
        ["httpGet", "tcpSocket"]
            .into_iter()
            .filter_map(|k| handler?.get(k)?.get("host")?.as_str())
            .filter(|h| !h.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let mut bad = BTreeSet::new();
    let mut forbidden_hosts = BTreeSet::new();
    for c in pod.containers() {
        let lifecycle = c.get("lifecycle");
        let handlers = [
            c.get("livenessProbe"),
            c.get("readinessProbe"),
            c.get("startupProbe"),
            lifecycle.and_then(|l| l.get("postStart")),
            lifecycle.and_then(|l| l.get("preStop")),
        ];
        for handler in handlers {
            let found = hosts(handler);
            if !found.is_empty() {
                bad.insert(name(c));
                forbidden_hosts.extend(found);
            }
        }
    }
    if bad.is_empty() {
        return None;
    }
    let bad: Vec<String> = bad.into_iter().collect();
    forbidden(
        "probe or lifecycle host",
        format!(
            "{} {} {} {}",
            containers_phrase(&bad),
            pluralize("uses", "use", bad.len()),
            pluralize(
                "probe or lifecycle host",
                "probe or lifecycle hosts",
                forbidden_hosts.len()
            ),
            join_quote(&forbidden_hosts)
        ),
    )
}

fn privileged(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    let bad: Vec<String> = pod
        .containers()
        .filter(|c| context_field(c, "privileged").and_then(Value::as_bool) == Some(true))
        .map(name)
        .collect();
    if bad.is_empty() {
        return None;
    }
    forbidden(
        "privileged",
        format!(
            "{} must not set securityContext.privileged=true",
            containers_phrase(&bad)
        ),
    )
}

fn proc_mount(pod: &Pod, minor: u32) -> Option<Forbidden> {
    // A pod in a user namespace of its own may unmask /proc (Kubernetes 1.34).
    if minor >= 34 && pod.own_user_namespace() {
        return None;
    }
    let mut bad = Vec::new();
    let mut types = BTreeSet::new();
    for c in pod.containers() {
        if let Some(t) = context_field(c, "procMount").and_then(Value::as_str)
            && t != "Default"
        {
            bad.push(name(c));
            types.insert(t.to_owned());
        }
    }
    if bad.is_empty() {
        return None;
    }
    forbidden(
        "procMount",
        format!(
            "{} must not set securityContext.procMount to {}",
            containers_phrase(&bad),
            join_quote(&types)
        ),
    )
}

fn se_linux_options(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    const ALLOWED_TYPES: &[&str] = &["", "container_t", "container_init_t", "container_kvm_t"];
    let mut bad_types = BTreeSet::new();
    let (mut set_user, mut set_role) = (false, false);
    let mut valid = |opts: &Value| {
        let field = |k: &str| opts.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let mut ok = true;
        let t = field("type");
        if !ALLOWED_TYPES.contains(&t.as_str()) {
            ok = false;
            bad_types.insert(t);
        }
        if !field("user").is_empty() {
            ok = false;
            set_user = true;
        }
        if !field("role").is_empty() {
            ok = false;
            set_role = true;
        }
        ok
    };
    let mut setters = Vec::new();
    if let Some(opts) = pod.security_context().and_then(|s| s.get("seLinuxOptions"))
        && !valid(opts)
    {
        setters.push("pod".to_owned());
    }
    let mut bad = Vec::new();
    for c in pod.containers() {
        if let Some(opts) = context_field(c, "seLinuxOptions")
            && !valid(opts)
        {
            bad.push(name(c));
        }
    }
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    if setters.is_empty() {
        return None;
    }
    let mut data = Vec::new();
    if !bad_types.is_empty() {
        data.push(format!(
            "{} {}",
            pluralize("type", "types", bad_types.len()),
            join_quote(&bad_types)
        ));
    }
    if set_user {
        data.push("user may not be set".to_owned());
    }
    if set_role {
        data.push("role may not be set".to_owned());
    }
    forbidden(
        "seLinuxOptions",
        format!(
            "{} set forbidden securityContext.seLinuxOptions: {}",
            setters.join(" and "),
            data.join("; ")
        ),
    )
}

fn sysctls(pod: &Pod, minor: u32) -> Option<Forbidden> {
    const V1_0: &[&str] = &[
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_unprivileged_port_start",
    ];
    const V1_27: &[&str] = &["net.ipv4.ip_local_reserved_ports"];
    const V1_29: &[&str] = &[
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    ];
    const V1_32: &[&str] = &["net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"];
    let allowed = |s: &str| {
        V1_0.contains(&s)
            || (minor >= 27 && V1_27.contains(&s))
            || (minor >= 29 && V1_29.contains(&s))
            || (minor >= 32 && V1_32.contains(&s))
    };
    let bad: Vec<&str> = pod
        .security_context()
        .and_then(|s| s.get("sysctls"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.get("name").and_then(Value::as_str))
        .filter(|s| !allowed(s))
        .collect();
    if bad.is_empty() {
        return None;
    }
    forbidden("forbidden sysctls", bad.join(", "))
}

fn windows_host_process(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    let host_process = |sc: Option<&Value>| {
        sc.and_then(|s| s.get("windowsOptions"))
            .and_then(|w| w.get("hostProcess"))
            .and_then(Value::as_bool)
            == Some(true)
    };
    let setters = setters_of(pod, host_process);
    if setters.is_empty() {
        return None;
    }
    forbidden(
        "hostProcess",
        format!(
            "{} must not set securityContext.windowsOptions.hostProcess=true",
            setters.join(" and ")
        ),
    )
}

// ---- baseline, superseded at restricted ----

fn capabilities_baseline(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    const ALLOWED: &[&str] = &[
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    ];
    let mut bad = Vec::new();
    let mut caps = BTreeSet::new();
    for c in pod.containers() {
        let mut valid = true;
        for cap in added_capabilities(c) {
            if !ALLOWED.contains(&cap) {
                valid = false;
                caps.insert(cap.to_owned());
            }
        }
        if !valid {
            bad.push(name(c));
        }
    }
    if bad.is_empty() {
        return None;
    }
    forbidden(
        "non-default capabilities",
        format!(
            "{} must not include {} in securityContext.capabilities.add",
            containers_phrase(&bad),
            join_quote(&caps)
        ),
    )
}

fn added_capabilities(c: &Value) -> impl Iterator<Item = &str> {
    context_field(c, "capabilities")
        .and_then(|caps| caps.get("add"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
}

fn host_path_volumes(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    let bad: Vec<String> = volumes(pod)
        .filter(|v| v.get("hostPath").is_some_and(|h| !h.is_null()))
        .map(name)
        .collect();
    if bad.is_empty() {
        return None;
    }
    forbidden(
        "hostPath volumes",
        format!(
            "{} {}",
            pluralize("volume", "volumes", bad.len()),
            join_quote(&bad)
        ),
    )
}

fn volumes<'a>(pod: &'a Pod) -> impl Iterator<Item = &'a Value> {
    pod.spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn valid_seccomp(profile: &Value) -> bool {
    matches!(
        profile.get("type").and_then(Value::as_str),
        Some("RuntimeDefault" | "Localhost")
    )
}

fn seccomp_baseline(pod: &Pod, minor: u32) -> Option<Forbidden> {
    if minor < 19 {
        // Before the field, the alpha annotations said it.
        const POD_KEY: &str = "seccomp.security.alpha.kubernetes.io/pod";
        let valid = |v: &str| {
            v == "runtime/default" || v == "docker/default" || v.starts_with("localhost/")
        };
        let mut bad = BTreeSet::new();
        if let Some(v) = pod.annotation(POD_KEY)
            && !valid(v)
        {
            bad.insert(format!("{POD_KEY}={}", Value::String(v.to_owned())));
        }
        for c in pod.containers() {
            let key = format!("container.seccomp.security.alpha.kubernetes.io/{}", name(c));
            if let Some(v) = pod.annotation(&key)
                && !valid(v)
            {
                bad.insert(format!("{key}={}", Value::String(v.to_owned())));
            }
        }
        if bad.is_empty() {
            return None;
        }
        return forbidden(
            "seccompProfile",
            format!(
                "forbidden {} {}",
                pluralize("annotation", "annotations", bad.len()),
                bad.into_iter().collect::<Vec<_>>().join(", ")
            ),
        );
    }
    let mut setters = Vec::new();
    let mut values = BTreeSet::new();
    if let Some(profile) = pod.security_context().and_then(|s| s.get("seccompProfile"))
        && !valid_seccomp(profile)
    {
        setters.push("pod".to_owned());
        values.insert(profile_type(profile));
    }
    let mut bad = Vec::new();
    for c in pod.containers() {
        if let Some(profile) = context_field(c, "seccompProfile")
            && !valid_seccomp(profile)
        {
            bad.push(name(c));
            values.insert(profile_type(profile));
        }
    }
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    if setters.is_empty() {
        return None;
    }
    forbidden(
        "seccompProfile",
        format!(
            "{} must not set securityContext.seccompProfile.type to {}",
            setters.join(" and "),
            join_quote(&values)
        ),
    )
}

// ---- restricted ----

fn allow_privilege_escalation(pod: &Pod, minor: u32) -> Option<Forbidden> {
    if minor >= 25 && pod.windows() {
        return None;
    }
    let bad: Vec<String> = pod
        .containers()
        .filter(|c| {
            context_field(c, "allowPrivilegeEscalation").and_then(Value::as_bool) != Some(false)
        })
        .map(name)
        .collect();
    if bad.is_empty() {
        return None;
    }
    forbidden(
        "allowPrivilegeEscalation != false",
        format!(
            "{} must set securityContext.allowPrivilegeEscalation=false",
            containers_phrase(&bad)
        ),
    )
}

fn capabilities_restricted(pod: &Pod, minor: u32) -> Option<Forbidden> {
    if minor < 22 || (minor >= 25 && pod.windows()) {
        return None;
    }
    let mut missing_drop_all = Vec::new();
    let mut adding = Vec::new();
    let mut caps = BTreeSet::new();
    for c in pod.containers() {
        let Some(capabilities) = context_field(c, "capabilities").filter(|v| !v.is_null()) else {
            missing_drop_all.push(name(c));
            continue;
        };
        let dropped_all = capabilities
            .get("drop")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .any(|d| d.as_str() == Some("ALL"));
        if !dropped_all {
            missing_drop_all.push(name(c));
        }
        let mut added_forbidden = false;
        for cap in added_capabilities(c) {
            if cap != "NET_BIND_SERVICE" {
                added_forbidden = true;
                caps.insert(cap.to_owned());
            }
        }
        if added_forbidden {
            adding.push(name(c));
        }
    }
    let mut details = Vec::new();
    if !missing_drop_all.is_empty() {
        details.push(format!(
            "{} must set securityContext.capabilities.drop=[\"ALL\"]",
            containers_phrase(&missing_drop_all)
        ));
    }
    if !adding.is_empty() {
        details.push(format!(
            "{} must not include {} in securityContext.capabilities.add",
            containers_phrase(&adding),
            join_quote(&caps)
        ));
    }
    if details.is_empty() {
        return None;
    }
    forbidden("unrestricted capabilities", details.join("; "))
}

fn restricted_volumes(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    const ALLOWED: &[&str] = &[
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    // Kubernetes' names for the types it knows; anything else is "unknown".
    const KNOWN: &[&str] = &[
        "hostPath",
        "gcePersistentDisk",
        "awsElasticBlockStore",
        "gitRepo",
        "nfs",
        "iscsi",
        "glusterfs",
        "rbd",
        "flexVolume",
        "cinder",
        "cephfs",
        "flocker",
        "fc",
        "azureFile",
        "vsphereVolume",
        "quobyte",
        "azureDisk",
        "photonPersistentDisk",
        "portworxVolume",
        "scaleIO",
        "storageos",
    ];
    let mut bad = Vec::new();
    let mut types = BTreeSet::new();
    for v in volumes(pod) {
        let set: Vec<&str> = v
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, val)| k.as_str() != "name" && !val.is_null())
            .map(|(k, _)| k.as_str())
            .collect();
        if set.iter().any(|k| ALLOWED.contains(k)) {
            continue;
        }
        bad.push(name(v));
        let known = KNOWN.iter().find(|k| set.contains(k));
        types.insert(known.copied().unwrap_or("unknown"));
    }
    if bad.is_empty() {
        return None;
    }
    forbidden(
        "restricted volume types",
        format!(
            "{} {} {} {} {}",
            pluralize("volume", "volumes", bad.len()),
            join_quote(&bad),
            pluralize("uses", "use", bad.len()),
            pluralize(
                "restricted volume type",
                "restricted volume types",
                types.len()
            ),
            join_quote(&types)
        ),
    )
}

fn run_as_non_root(pod: &Pod, _minor: u32) -> Option<Forbidden> {
    let mut setters = Vec::new();
    let mut pod_non_root = false;
    match pod
        .security_context()
        .and_then(|s| s.get("runAsNonRoot"))
        .and_then(Value::as_bool)
    {
        Some(false) => setters.push("pod".to_owned()),
        Some(true) => pod_non_root = true,
        None => {}
    }
    let mut explicit = Vec::new();
    let mut implicit = Vec::new();
    for c in pod.containers() {
        match context_field(c, "runAsNonRoot").and_then(Value::as_bool) {
            Some(false) => explicit.push(name(c)),
            Some(true) => {}
            None if !pod_non_root => implicit.push(name(c)),
            None => {}
        }
    }
    if !explicit.is_empty() {
        setters.push(containers_phrase(&explicit));
    }
    if !setters.is_empty() {
        return forbidden(
            "runAsNonRoot != true",
            format!(
                "{} must not set securityContext.runAsNonRoot=false",
                setters.join(" and ")
            ),
        );
    }
    if !implicit.is_empty() {
        return forbidden(
            "runAsNonRoot != true",
            format!(
                "pod or {} must set securityContext.runAsNonRoot=true",
                containers_phrase(&implicit)
            ),
        );
    }
    None
}

fn run_as_user(pod: &Pod, minor: u32) -> Option<Forbidden> {
    if minor < 23 {
        return None;
    }
    let root =
        |sc: Option<&Value>| sc.and_then(|s| s.get("runAsUser")).and_then(Value::as_i64) == Some(0);
    let setters = setters_of(pod, root);
    if setters.is_empty() {
        return None;
    }
    forbidden(
        "runAsUser=0",
        format!("{} must not set runAsUser=0", setters.join(" and ")),
    )
}

fn seccomp_restricted(pod: &Pod, minor: u32) -> Option<Forbidden> {
    if minor < 19 || (minor >= 25 && pod.windows()) {
        return None;
    }
    let mut setters = Vec::new();
    let mut values = BTreeSet::new();
    let mut pod_set = false;
    if let Some(profile) = pod.security_context().and_then(|s| s.get("seccompProfile")) {
        if valid_seccomp(profile) {
            pod_set = true;
        } else {
            setters.push("pod".to_owned());
            values.insert(profile_type(profile));
        }
    }
    let mut explicit = Vec::new();
    let mut implicit = Vec::new();
    for c in pod.containers() {
        match context_field(c, "seccompProfile") {
            Some(profile) if !valid_seccomp(profile) => {
                explicit.push(name(c));
                values.insert(profile_type(profile));
            }
            Some(_) => {}
            None if !pod_set => implicit.push(name(c)),
            None => {}
        }
    }
    if !explicit.is_empty() {
        setters.push(containers_phrase(&explicit));
    }
    if !setters.is_empty() {
        return forbidden(
            "seccompProfile",
            format!(
                "{} must not set securityContext.seccompProfile.type to {}",
                setters.join(" and "),
                join_quote(&values)
            ),
        );
    }
    if !implicit.is_empty() {
        return forbidden(
            "seccompProfile",
            format!(
                "pod or {} must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\"",
                containers_phrase(&implicit)
            ),
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const BASELINE: LevelVersion = LevelVersion::new(Level::Baseline, Version::Latest);
    const RESTRICTED: LevelVersion = LevelVersion::new(Level::Restricted, Version::Latest);

    fn check(lv: LevelVersion, pod: Value) -> String {
        let empty = json!({});
        evaluate(
            lv,
            pod.get("metadata").unwrap_or(&empty),
            pod.get("spec").unwrap_or(&empty),
        )
        .details()
    }

    fn container(name: &str, security_context: Value) -> Value {
        json!({"name": name, "image": "x", "securityContext": security_context})
    }

    /// A pod that passes restricted, to which each test adds one fault.
    fn restricted_pod() -> Value {
        json!({"spec": {
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container("app", json!({
                "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
            }))],
            "volumes": [{"name": "data", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "c"}}],
        }})
    }

    #[test]
    fn a_restricted_pod_passes_every_level() {
        for lv in [BASELINE, RESTRICTED] {
            assert_eq!(check(lv, restricted_pod()), "");
        }
    }

    #[test]
    fn an_empty_pod_fails_restricted_with_kubernetes_message() {
        let pod = json!({"spec": {"containers": [{"name": "nginx", "image": "nginx"}]}});
        assert_eq!(check(BASELINE, pod.clone()), "");
        assert_eq!(
            check(RESTRICTED, pod),
            "allowPrivilegeEscalation != false (container \"nginx\" must set securityContext.allowPrivilegeEscalation=false), \
             unrestricted capabilities (container \"nginx\" must set securityContext.capabilities.drop=[\"ALL\"]), \
             runAsNonRoot != true (pod or container \"nginx\" must set securityContext.runAsNonRoot=true), \
             seccompProfile (pod or container \"nginx\" must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")"
        );
    }

    #[test]
    fn host_namespaces_ports_and_privileged_fail_baseline() {
        let mut pod = restricted_pod();
        pod["spec"]["hostNetwork"] = json!(true);
        pod["spec"]["hostPID"] = json!(true);
        pod["spec"]["containers"][0]["securityContext"]["privileged"] = json!(true);
        pod["spec"]["containers"][0]["ports"] = json!([{"containerPort": 80, "hostPort": 8080}, {"containerPort": 9, "hostPort": 10000}]);
        let expected = "host namespaces (hostNetwork=true, hostPID=true), \
             hostPort (container \"app\" uses hostPorts 10000, 8080), \
             privileged (container \"app\" must not set securityContext.privileged=true)";
        assert_eq!(check(BASELINE, pod.clone()), expected);
        assert_eq!(check(RESTRICTED, pod), expected);
    }

    #[test]
    fn capabilities_beyond_the_default_set_fail_baseline_and_any_but_net_bind_service_restricted() {
        let mut pod = restricted_pod();
        pod["spec"]["initContainers"] = json!([container(
            "init",
            json!({
                "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
            })
        )]);
        pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] =
            json!(["NET_ADMIN", "SYS_ADMIN"]);
        assert_eq!(
            check(BASELINE, pod.clone()),
            "non-default capabilities (container \"app\" must not include \"NET_ADMIN\", \"SYS_ADMIN\" in securityContext.capabilities.add)"
        );
        assert_eq!(
            check(RESTRICTED, pod),
            "unrestricted capabilities (containers \"init\", \"app\" must not include \"CHOWN\", \"NET_ADMIN\", \"SYS_ADMIN\" in securityContext.capabilities.add)"
        );
    }

    #[test]
    fn host_path_fails_baseline_and_restricted_names_the_type() {
        let mut pod = restricted_pod();
        pod["spec"]["volumes"] = json!([{"name": "root", "hostPath": {"path": "/"}}, {"name": "n", "nfs": {"server": "s", "path": "/"}}]);
        assert_eq!(
            check(BASELINE, pod.clone()),
            "hostPath volumes (volume \"root\")"
        );
        assert_eq!(
            check(RESTRICTED, pod),
            "restricted volume types (volumes \"root\", \"n\" use restricted volume types \"hostPath\", \"nfs\")"
        );
    }

    #[test]
    fn security_options_fail_baseline() {
        let mut pod = restricted_pod();
        let sc = &mut pod["spec"]["containers"][0]["securityContext"];
        sc["procMount"] = json!("Unmasked");
        sc["seLinuxOptions"] = json!({"type": "spc_t", "user": "root"});
        sc["seccompProfile"] = json!({"type": "Unconfined"});
        sc["appArmorProfile"] = json!({"type": "Unconfined"});
        sc["windowsOptions"] = json!({"hostProcess": true});
        pod["spec"]["securityContext"]["sysctls"] = json!([{"name": "kernel.msgmax", "value": "1"}, {"name": "net.ipv4.tcp_rmem", "value": "1"}]);
        pod["spec"]["containers"][0]["readinessProbe"] =
            json!({"httpGet": {"host": "10.0.0.1", "port": 80}});
        assert_eq!(
            check(BASELINE, pod.clone()),
            "forbidden AppArmor profile (container \"app\" must not set AppArmor profile type to \"Unconfined\"), \
             probe or lifecycle host (container \"app\" uses probe or lifecycle host \"10.0.0.1\"), \
             procMount (container \"app\" must not set securityContext.procMount to \"Unmasked\"), \
             seLinuxOptions (container \"app\" set forbidden securityContext.seLinuxOptions: type \"spc_t\"; user may not be set), \
             forbidden sysctls (kernel.msgmax), \
             hostProcess (container \"app\" must not set securityContext.windowsOptions.hostProcess=true), \
             seccompProfile (container \"app\" must not set securityContext.seccompProfile.type to \"Unconfined\")"
        );
        // The restricted seccomp check replaces the baseline one.
        assert!(check(RESTRICTED, pod).ends_with(
            "seccompProfile (container \"app\" must not set securityContext.seccompProfile.type to \"Unconfined\")"
        ));
    }

    #[test]
    fn restricted_runs_as_non_root_with_no_root_user() {
        let mut pod = restricted_pod();
        pod["spec"]["securityContext"]["runAsNonRoot"] = json!(false);
        pod["spec"]["containers"][0]["securityContext"]["runAsUser"] = json!(0);
        pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = json!(true);
        assert_eq!(
            check(RESTRICTED, pod),
            "allowPrivilegeEscalation != false (container \"app\" must set securityContext.allowPrivilegeEscalation=false), \
             runAsNonRoot != true (pod must not set securityContext.runAsNonRoot=false), \
             runAsUser=0 (container \"app\" must not set runAsUser=0)"
        );
    }

    #[test]
    fn older_versions_check_what_they_checked_then() {
        let at = |minor| LevelVersion::new(Level::Restricted, Version::V1(minor));
        let mut pod = restricted_pod();
        pod["spec"]["containers"][0]["securityContext"]["runAsUser"] = json!(0);
        pod["spec"]["containers"][0]["securityContext"]["capabilities"] = json!({});
        pod["spec"]["containers"][0]["readinessProbe"] =
            json!({"tcpSocket": {"host": "h", "port": 1}});
        pod["spec"]["securityContext"]["sysctls"] =
            json!([{"name": "net.ipv4.tcp_rmem", "value": "1"}]);
        // v1.21: no runAsUser, no drop-ALL, no probe host check; tcp_rmem not yet safe.
        assert_eq!(
            check(at(21), pod.clone()),
            "forbidden sysctls (net.ipv4.tcp_rmem)"
        );
        let v1_23 = check(at(23), pod.clone());
        assert!(v1_23.contains("runAsUser=0") && v1_23.contains("drop=[\"ALL\"]"));
        assert!(!v1_23.contains("probe or lifecycle host"));
        assert!(check(at(99), pod).contains("probe or lifecycle host"));
        // v1.18: seccomp by annotation.
        let old = json!({"metadata": {"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}},
                         "spec": {"containers": [{"name": "a"}]}});
        assert_eq!(
            check(LevelVersion::new(Level::Baseline, Version::V1(18)), old),
            "seccompProfile (forbidden annotation seccomp.security.alpha.kubernetes.io/pod=\"unconfined\")"
        );
    }

    #[test]
    fn versions_and_levels_parse_as_kubernetes_reads_labels() {
        assert_eq!(Version::parse("v1.25"), Ok(Version::V1(25)));
        assert_eq!(Version::parse("latest"), Ok(Version::Latest));
        for bad in ["v1.025", "v2.0", "1.25", "v1.", "v1.-1", "v1.x"] {
            assert!(Version::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Level::parse("baseline"), Ok(Level::Baseline));
        assert!(Level::parse("Baseline").is_err());
        assert_eq!(
            LevelVersion::new(Level::Restricted, Version::V1(30)).to_string(),
            "restricted:v1.30"
        );
    }
}
