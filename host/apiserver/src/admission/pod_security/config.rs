//! The cluster's Pod Security defaults and exemptions: Kubernetes'
//! `PodSecurityConfiguration` (`pod-security.admission.config.k8s.io/v1`, also
//! `v1beta1`/`v1alpha1`, the same fields), read from its own file or from the
//! `PodSecurity` entry of an `AdmissionConfiguration` (inline `configuration`, or a
//! `path` relative to that file), as kube-apiserver's `--admission-control-config-file`.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::policy::{Level, LevelVersion, Version};

/// The level and version of each mode for namespaces whose labels do not say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub enforce: LevelVersion,
    pub audit: LevelVersion,
    pub warn: LevelVersion,
}

impl Policy {
    /// Every mode at `level`, version `latest`.
    pub const fn all(level: Level) -> Self {
        let lv = LevelVersion::new(level, Version::Latest);
        Self {
            enforce: lv,
            audit: lv,
            warn: lv,
        }
    }
}

/// Who and what is never evaluated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exemptions {
    pub usernames: Vec<String>,
    pub namespaces: Vec<String>,
    pub runtime_classes: Vec<String>,
}

/// The Pod Security admission's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub defaults: Policy,
    pub exemptions: Exemptions,
}

impl Default for Config {
    /// Trellis' default, stricter than Kubernetes' (`privileged` everywhere): pods are
    /// held to `baseline` (no host namespaces, host paths, privileged containers,
    /// added capabilities…), and warned and audited against `restricted`.
    /// `kube-system` is exempt: the cluster's own components run there.
    fn default() -> Self {
        let latest = |level| LevelVersion::new(level, Version::Latest);
        Self {
            defaults: Policy {
                enforce: latest(Level::Baseline),
                audit: latest(Level::Restricted),
                warn: latest(Level::Restricted),
            },
            exemptions: Exemptions {
                namespaces: vec!["kube-system".into()],
                ..Exemptions::default()
            },
        }
    }
}

impl Config {
    /// Kubernetes' own default: nothing enforced, nothing warned.
    pub fn privileged() -> Self {
        Self {
            defaults: Policy::all(Level::Privileged),
            exemptions: Exemptions::default(),
        }
    }

    /// Reads a `PodSecurityConfiguration` or an `AdmissionConfiguration` holding
    /// one (YAML or JSON). An `AdmissionConfiguration` without a `PodSecurity` entry
    /// gives Trellis' default.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))?;
        let doc: Value =
            serde_saphyr::from_str(&text).map_err(|e| format!("parse {}: {e}", path.display()))?;
        match doc.get("kind").and_then(Value::as_str) {
            Some("AdmissionConfiguration") => {
                let plugin = doc
                    .get("plugins")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .find(|p| p.get("name").and_then(Value::as_str) == Some("PodSecurity"));
                let Some(plugin) = plugin else {
                    return Ok(Self::default());
                };
                if let Some(inline) = plugin.get("configuration").filter(|c| !c.is_null()) {
                    return Self::from_value(inline)
                        .map_err(|e| format!("{}: {e}", path.display()));
                }
                let Some(relative) = plugin.get("path").and_then(Value::as_str) else {
                    return Err(format!(
                        "{}: the PodSecurity plugin has neither configuration nor path",
                        path.display()
                    ));
                };
                let base = path.parent().unwrap_or(Path::new("."));
                Self::load(&base.join(relative))
            }
            _ => Self::from_value(&doc).map_err(|e| format!("{}: {e}", path.display())),
        }
    }

    /// Reads a `PodSecurityConfiguration` object. Defaults a file leaves out are
    /// Kubernetes' (`privileged`, `latest`); a level or version that is not valid
    /// is an error, as kube-apiserver refuses to start with it.
    pub fn from_value(doc: &Value) -> Result<Self, String> {
        let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        if !matches!(
            api_version,
            "pod-security.admission.config.k8s.io/v1"
                | "pod-security.admission.config.k8s.io/v1beta1"
                | "pod-security.admission.config.k8s.io/v1alpha1"
        ) {
            return Err(format!(
                "apiVersion {api_version:?}: expected pod-security.admission.config.k8s.io/v1"
            ));
        }
        if doc.get("kind").and_then(Value::as_str) != Some("PodSecurityConfiguration") {
            return Err("kind: expected PodSecurityConfiguration".into());
        }
        let file: File = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
        let defaults = file.defaults.unwrap_or_default();
        let mode = |level: &Option<String>, version: &Option<String>, name: &str| {
            let level = match level.as_deref() {
                None | Some("") => Level::Privileged,
                Some(l) => Level::parse(l).map_err(|e| format!("defaults.{name}: {e}"))?,
            };
            let version = match version.as_deref() {
                None | Some("") => Version::Latest,
                Some(v) => {
                    Version::parse(v).map_err(|e| format!("defaults.{name}-version: {e}"))?
                }
            };
            Ok::<_, String>(LevelVersion::new(level, version))
        };
        let exemptions = file.exemptions.unwrap_or_default();
        Ok(Self {
            defaults: Policy {
                enforce: mode(&defaults.enforce, &defaults.enforce_version, "enforce")?,
                audit: mode(&defaults.audit, &defaults.audit_version, "audit")?,
                warn: mode(&defaults.warn, &defaults.warn_version, "warn")?,
            },
            exemptions: Exemptions {
                usernames: exemptions.usernames,
                namespaces: exemptions.namespaces,
                runtime_classes: exemptions.runtime_classes,
            },
        })
    }
}

#[derive(Deserialize)]
struct File {
    defaults: Option<Defaults>,
    exemptions: Option<FileExemptions>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Defaults {
    enforce: Option<String>,
    enforce_version: Option<String>,
    audit: Option<String>,
    audit_version: Option<String>,
    warn: Option<String>,
    warn_version: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileExemptions {
    #[serde(default)]
    usernames: Vec<String>,
    #[serde(default)]
    namespaces: Vec<String>,
    #[serde(default)]
    runtime_classes: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "apiVersion: pod-security.admission.config.k8s.io/v1
kind: PodSecurityConfiguration
defaults:
  enforce: restricted
  enforce-version: v1.30
  warn: baseline
exemptions:
  usernames: [system:serviceaccount:ci:deployer]
  runtimeClasses: [kata]
  namespaces: [kube-system, monitoring]
";

    #[test]
    fn reads_kubernetes_configuration_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("psa.yaml");
        std::fs::write(&path, FILE).unwrap();
        let config = Config::load(&path).unwrap();
        assert_eq!(
            config.defaults.enforce,
            LevelVersion::new(Level::Restricted, Version::V1(30))
        );
        assert_eq!(config.defaults.warn.level, Level::Baseline);
        // Left out: Kubernetes' default.
        assert_eq!(
            config.defaults.audit,
            LevelVersion::new(Level::Privileged, Version::Latest)
        );
        assert_eq!(config.exemptions.runtime_classes, ["kata"]);
        assert_eq!(config.exemptions.namespaces, ["kube-system", "monitoring"]);
    }

    #[test]
    fn reads_the_plugin_entry_of_an_admission_configuration() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("psa.yaml"), FILE).unwrap();
        let by_path = dir.path().join("admission.yaml");
        std::fs::write(
            &by_path,
            "apiVersion: apiserver.config.k8s.io/v1\nkind: AdmissionConfiguration\nplugins:\n- name: PodSecurity\n  path: psa.yaml\n",
        )
        .unwrap();
        assert_eq!(
            Config::load(&by_path).unwrap().exemptions.runtime_classes,
            ["kata"]
        );
        let inline = dir.path().join("inline.yaml");
        let indented: String = FILE.lines().map(|l| format!("    {l}\n")).collect();
        std::fs::write(
            &inline,
            format!("apiVersion: apiserver.config.k8s.io/v1\nkind: AdmissionConfiguration\nplugins:\n- name: PodSecurity\n  configuration:\n{indented}"),
        )
        .unwrap();
        assert_eq!(
            Config::load(&inline).unwrap().defaults.enforce.level,
            Level::Restricted
        );
    }

    #[test]
    fn refuses_invalid_levels_and_kinds() {
        let bad = serde_json::json!({"apiVersion": "pod-security.admission.config.k8s.io/v1",
            "kind": "PodSecurityConfiguration", "defaults": {"enforce": "strict"}});
        assert!(
            Config::from_value(&bad)
                .unwrap_err()
                .contains("defaults.enforce")
        );
        let wrong = serde_json::json!({"apiVersion": "v1", "kind": "PodSecurityConfiguration"});
        assert!(Config::from_value(&wrong).is_err());
    }
}
