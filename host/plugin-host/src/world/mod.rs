//! The kinds of plugin, each a WIT world: what a component of the kind exports, the
//! imports its world adds to the shared ones, and the calls the host makes into it.
//!
//! A world is a type implementing [`World`]; each call into it is a type
//! implementing [`Call`] (`admission::Admit`, `initializer::Initialize`,
//! `controller::Reconcile`). Worlds whose components export one handler with
//! `validate-configuration` are declared with [`handler_world!`]. The machinery
//! around a call (instance pool, deadline, memory cap, failures, metrics, the threads
//! guest code runs on) is generic over the world and lives in [`crate::plugin`] and
//! [`crate::calls`]: a new world is a module here, a [`PluginKind`] that names it, an
//! arm in `PluginHost::load`'s choice of world, and a `Plugin` method in
//! [`crate::calls`] that makes its calls.
//!
//! A world serves every version of its package the host still supports: `pre` finds
//! the version a component implements, and its exports and calls dispatch on it.

use std::future::Future;

use wasmtime::Store;
use wasmtime::component::{InstancePre, Linker};

use crate::state::PluginState;

pub(crate) mod admission;
pub(crate) mod controller;
pub(crate) mod initializer;
pub(crate) mod scheduler;

/// A world whose components export one handler interface with
/// `validate-configuration`, in every version the host serves, newest first: the
/// world's type, `Pre` and `Exports` with a variant per version, and its [`World`]
/// impl. Each version's generated bindings are types of their own with no trait in
/// common, hence a macro rather than a generic.
///
/// ```ignore
/// handler_world! {
///     /// The `admission` world.
///     Admission = "admission",
///     versions: [
///         V0_1: admission::AdmissionPre<PluginState>, admission::Admission,
///             trellis_admission_handler ("trellis:admission/handler@0.1.0"),
///     ],
///     imports: add_imports,   // optional: the world's own imports
/// }
/// ```
macro_rules! handler_world {
    (
        $(#[$doc:meta])*
        $world:ident = $name:literal,
        versions: [
            $newest:ident: $newest_pre:ty, $newest_exports:ty, $newest_handler:ident ($newest_export:literal)
            $(, $older:ident: $older_pre:ty, $older_exports:ty, $older_handler:ident ($older_export:literal))*
            $(,)?
        ],
        $(imports: $add_imports:path,)?
    ) => {
        $(#[$doc])*
        pub(crate) struct $world;

        /// A component linked against one version of the world.
        pub(crate) enum Pre {
            $newest($newest_pre),
            $($older($older_pre),)*
        }

        /// One instance's exports, of the version its component implements.
        pub(crate) enum Exports {
            $newest($newest_exports),
            $($older($older_exports),)*
        }

        impl $crate::world::World for $world {
            const NAME: &'static str = $name;
            const EXPORTS: &'static [&'static str] = &[$newest_export $(, $older_export)*];
            type Pre = Pre;
            type Exports = Exports;

            $(
                fn add_to_linker(
                    linker: &mut ::wasmtime::component::Linker<$crate::state::PluginState>,
                ) -> ::wasmtime::Result<()> {
                    $add_imports(linker)
                }
            )?

            fn pre(
                instance_pre: ::wasmtime::component::InstancePre<$crate::state::PluginState>,
            ) -> ::wasmtime::Result<Pre> {
                match <$newest_pre>::new(instance_pre.clone()) {
                    Ok(pre) => Ok(Pre::$newest(pre)),
                    Err(newest) => {
                        $(
                            if let Ok(pre) = <$older_pre>::new(instance_pre.clone()) {
                                return Ok(Pre::$older(pre));
                            }
                        )*
                        Err(newest)
                    }
                }
            }

            async fn instantiate(
                pre: &Pre,
                store: &mut ::wasmtime::Store<$crate::state::PluginState>,
            ) -> ::wasmtime::Result<Exports> {
                Ok(match pre {
                    Pre::$newest(pre) => Exports::$newest(pre.instantiate_async(store).await?),
                    $(Pre::$older(pre) => Exports::$older(pre.instantiate_async(store).await?),)*
                })
            }

            async fn validate_configuration<'a>(
                exports: &'a Exports,
                store: &'a mut ::wasmtime::Store<$crate::state::PluginState>,
                configuration: &'a str,
            ) -> ::wasmtime::Result<Result<(), String>> {
                match exports {
                    Exports::$newest(e) => {
                        e.$newest_handler()
                            .call_validate_configuration(store, configuration)
                            .await
                    }
                    $(
                        Exports::$older(e) => {
                            e.$older_handler()
                                .call_validate_configuration(store, configuration)
                                .await
                        }
                    )*
                }
            }
        }
    };
}
pub(crate) use handler_world;

/// One kind of plugin.
pub(crate) trait World: Sized + Send + Sync + 'static {
    /// How errors and logs name the world.
    const NAME: &'static str;

    /// The handler interface a component of each supported version exports, newest
    /// first: what a refused component is told it lacks.
    const EXPORTS: &'static [&'static str];

    /// A component linked against one version of the world, ready to instantiate.
    type Pre: Send + Sync + 'static;

    /// One instance's exports.
    type Exports: Send + Sync + 'static;

    /// Adds the imports this world has beyond WASI and the shared ones
    /// ([`crate::imports`]), for every version it serves. Each world has a linker of
    /// its own, so an import added here reaches this world's plugins only.
    fn add_to_linker(linker: &mut Linker<PluginState>) -> wasmtime::Result<()> {
        let _ = linker;
        Ok(())
    }

    /// The version of the world the component implements (its exports checked);
    /// when none fits, the error of the newest.
    fn pre(instance_pre: InstancePre<PluginState>) -> wasmtime::Result<Self::Pre>;

    /// A new instance: runs the component's start functions.
    fn instantiate(
        pre: &Self::Pre,
        store: &mut Store<PluginState>,
    ) -> impl Future<Output = wasmtime::Result<Self::Exports>> + Send;

    /// `validate-configuration`, which every world exports: called once per load.
    fn validate_configuration<'a>(
        exports: &'a Self::Exports,
        store: &'a mut Store<PluginState>,
        configuration: &'a str,
    ) -> impl Future<Output = wasmtime::Result<Result<(), String>>> + Send + 'a;
}

/// One call into a world's exports, with what it needs; run on the host's call
/// threads, so it owns its arguments.
pub(crate) trait Call<W: World>: Send + 'static {
    type Output: Send + 'static;

    fn call<'a>(
        self,
        exports: &'a W::Exports,
        store: &'a mut Store<PluginState>,
    ) -> impl Future<Output = wasmtime::Result<Self::Output>> + Send + 'a;
}

/// What a plugin is, as its Plugin object's `spec.kind` says; each kind is served by
/// one world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PluginKind {
    Mutating,
    Validating,
    Initializer,
    Controller,
    Scheduler,
}

impl PluginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mutating => "mutating",
            Self::Validating => "validating",
            Self::Initializer => "initializer",
            Self::Controller => "controller",
            Self::Scheduler => "scheduler",
        }
    }

    /// The world a component of this kind must implement.
    pub fn world(self) -> &'static str {
        match self {
            Self::Mutating | Self::Validating => admission::Admission::NAME,
            Self::Initializer => initializer::Initializer::NAME,
            Self::Controller => controller::Controller::NAME,
            Self::Scheduler => scheduler::Scheduler::NAME,
        }
    }
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    //! Components built against the frozen `trellis:plugin@0.1.0` keep loading and
    //! answer as the same code built against today's packages: the Rust examples,
    //! which plugins/build.sh builds both ways.

    use std::time::Duration;

    use serde_json::{Value, json};

    use crate::testing::{built, host};
    use crate::{
        AdmissionRequest, GroupVersionKind, GroupVersionResource, HostConfig, InitializeRequest,
        PluginKind, PluginSpec, review,
    };

    /// The two builds of each example: the frozen contract's, then today's.
    const BUILDS: [&str; 2] = ["plugin-0.1.0/", ""];

    fn testdata(path: &str) -> Value {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/plugins")
            .join(path);
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    fn pod_create(pod: Value, configuration: &Value) -> AdmissionRequest {
        let review = json!({"request": {
            "uid": "u1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "object": pod,
        }});
        review::request_from_review(&review, &configuration.to_string()).unwrap()
    }

    /// What each build of an admission example answers to `requests` (as webhook
    /// responses), after checking that the build states the contract it should.
    async fn admit_both(
        example: &str,
        kind: PluginKind,
        configuration: &Value,
        requests: &[AdmissionRequest],
    ) -> Vec<Vec<Value>> {
        let host = host(HostConfig::default());
        let mut answers = Vec::new();
        for build in BUILDS {
            let wasm = built(&format!("{build}{example}"));
            assert_eq!(
                contains(&wasm, "trellis:plugin/admission-handler@0.1.0"),
                !build.is_empty(),
                "{build}{example} is not built against the contract it should be"
            );
            let mut spec = PluginSpec::new(example, kind);
            spec.configuration = configuration.to_string();
            // Unoptimized tests on a busy machine.
            spec.timeout = Duration::from_secs(5);
            let plugin = host.load(spec, wasm, None).await.unwrap();
            let mut build_answers = Vec::new();
            for request in requests {
                let answer = plugin.admit(&host, request).await.unwrap();
                let mut review = review::review_from_response("u1", &answer);
                build_answers.push(review["response"].take());
            }
            answers.push(build_answers);
        }
        answers
    }

    fn contains(wasm: &[u8], name: &str) -> bool {
        wasm.windows(name.len()).any(|w| w == name.as_bytes())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn examples_built_against_trellis_plugin_0_1_answer_as_built_today() {
        let policy =
            json!({"allowedRegistries": ["registry.k8s.io", "docker.io/library", "ghcr.io/acme/"]});
        let pods = [
            pod_create(testdata("pod-policy/testdata/good-pod.json"), &policy),
            pod_create(testdata("pod-policy/testdata/privileged-pod.json"), &policy),
        ];
        let [frozen, today] = <[_; 2]>::try_from(
            admit_both("pod-policy", PluginKind::Validating, &policy, &pods).await,
        )
        .unwrap();
        assert!(
            frozen[0]["allowed"] == true && frozen[1]["allowed"] == false,
            "{frozen:?}"
        );
        assert_eq!(frozen, today);

        let defaults = json!({"requests": {"cpu": "100m"}, "labels": {"defaulted": "true"}});
        let pod = [pod_create(
            testdata("pod-defaults/testdata/pod.json"),
            &defaults,
        )];
        let [frozen, today] = <[_; 2]>::try_from(
            admit_both("pod-defaults", PluginKind::Mutating, &defaults, &pod).await,
        )
        .unwrap();
        assert!(
            frozen[0]["allowed"] == true && frozen[0]["patch"].is_string(),
            "{frozen:?}"
        );
        assert_eq!(frozen, today);

        let host = host(HostConfig::default());
        let configmap = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "default", "uid": "1"}});
        let request = InitializeRequest {
            kind: GroupVersionKind {
                group: String::new(),
                version: "v1".into(),
                kind: "ConfigMap".into(),
            },
            resource: GroupVersionResource {
                group: String::new(),
                version: "v1".into(),
                resource: "configmaps".into(),
            },
            object: configmap.to_string(),
            configuration: json!({"annotation": "example.com/init"}).to_string(),
        };
        for build in BUILDS {
            let mut spec = PluginSpec::new("annotate-init", PluginKind::Initializer);
            spec.timeout = Duration::from_secs(5);
            let wasm = built(&format!("{build}annotate-init"));
            assert_eq!(
                contains(&wasm, "trellis:plugin/initializer-handler@0.1.0"),
                !build.is_empty()
            );
            let plugin = host.load(spec, wasm, None).await.unwrap();
            let object = plugin.initialize(&host, &request).await.unwrap().unwrap();
            let object: Value = serde_json::from_str(&object).unwrap();
            assert!(
                object["metadata"]["annotations"]["example.com/init"].is_string(),
                "{build}: {object}"
            );
        }
    }
}
