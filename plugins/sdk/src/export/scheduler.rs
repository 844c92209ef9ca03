//! The `scheduler` world's export: [`scheduler!`](crate::scheduler!) runs the plugins
//! a function builds from the configuration as one scheduling framework.

/// Exports a component of the `scheduler` world whose plugins `$build` makes from the
/// configuration: `fn(&str) -> Result<Vec<Box<dyn scheduler::Plugin>>, String>` (see
/// [`scheduler::Plugin`](crate::scheduler::Plugin)).
#[cfg(feature = "k8s-openapi")]
#[macro_export]
macro_rules! scheduler {
    ($build:path) => {
        #[doc(hidden)]
        const __TRELLIS_SCHEDULER_BUILD: fn(
            &str,
        ) -> Result<
            ::std::vec::Vec<::std::boxed::Box<dyn $crate::scheduler::Plugin>>,
            ::std::string::String,
        > = $build;

        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            let _ = __TRELLIS_SCHEDULER_BUILD;
        };

        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        mod __trellis_export {
            $crate::__bindings!(scheduler);
            $crate::__shared_glue!();

            use std::cell::RefCell;

            use $crate::scheduler as sch;

            thread_local! {
                static FRAMEWORK: RefCell<Option<sch::Framework>> = const { RefCell::new(None) };
            }

            fn with<T>(f: impl FnOnce(&mut sch::Framework) -> T, otherwise: T) -> T {
                sdk::with_host(host(), || {
                    FRAMEWORK.with(|fw| match fw.borrow_mut().as_mut() {
                        Some(fw) => f(fw),
                        None => otherwise,
                    })
                })
            }

            fn status(s: sch::Status) -> wit_scheduler::Status {
                wit_scheduler::Status {
                    code: match s.code {
                        sch::Code::Success => wit_scheduler::Code::Success,
                        sch::Code::Unschedulable => wit_scheduler::Code::Unschedulable,
                        sch::Code::UnschedulableAndUnresolvable => {
                            wit_scheduler::Code::UnschedulableAndUnresolvable
                        }
                        sch::Code::Skip => wit_scheduler::Code::Skip,
                        sch::Code::Error => wit_scheduler::Code::Error,
                    },
                    reasons: s.reasons,
                }
            }

            fn info(p: &dyn sch::Plugin) -> wit_scheduler::PluginInfo {
                let points = p.points();
                let mut flags = wit_scheduler::ExtensionPoints::empty();
                for (on, flag) in [
                    (
                        points.pre_filter,
                        wit_scheduler::ExtensionPoints::PRE_FILTER,
                    ),
                    (points.filter, wit_scheduler::ExtensionPoints::FILTER),
                    (points.pre_score, wit_scheduler::ExtensionPoints::PRE_SCORE),
                    (points.score, wit_scheduler::ExtensionPoints::SCORE),
                    (points.reserve, wit_scheduler::ExtensionPoints::RESERVE),
                    (points.permit, wit_scheduler::ExtensionPoints::PERMIT),
                ] {
                    if on {
                        flags |= flag;
                    }
                }
                let events = p
                    .events()
                    .into_iter()
                    .map(|e| {
                        let mut action = wit_scheduler::Action::empty();
                        for (on, flag) in [
                            (e.add, wit_scheduler::Action::ADD),
                            (e.update, wit_scheduler::Action::UPDATE),
                            (e.delete, wit_scheduler::Action::DELETE),
                        ] {
                            if on {
                                action |= flag;
                            }
                        }
                        wit_scheduler::ClusterEvent {
                            resource: e.resource,
                            action,
                        }
                    })
                    .collect();
                wit_scheduler::PluginInfo {
                    name: p.name().to_owned(),
                    points: flags,
                    weight: p.weight(),
                    events,
                }
            }

            struct Export;

            impl handler::Guest for Export {
                fn plugins(
                    configuration: String,
                ) -> Result<Vec<wit_scheduler::PluginInfo>, String> {
                    let plugins = sdk::with_host(host(), || {
                        (super::__TRELLIS_SCHEDULER_BUILD)(&configuration)
                    })?;
                    let infos = plugins.iter().map(|p| info(p.as_ref())).collect();
                    FRAMEWORK.with(|fw| *fw.borrow_mut() = Some(sch::Framework::new(plugins)));
                    Ok(infos)
                }

                fn update(changes: Vec<wit_scheduler::Change>) {
                    let changes = changes.into_iter().map(|c| match c {
                        wit_scheduler::Change::NodeUpsert(n) => sch::Change::NodeUpsert {
                            node: n.node,
                            object: n.object,
                        },
                        wit_scheduler::Change::NodeRemove(n) => sch::Change::NodeRemove(n),
                        wit_scheduler::Change::PodUpsert(p) => sch::Change::PodUpsert {
                            uid: p.uid,
                            node: p.node,
                            object: p.object,
                        },
                        wit_scheduler::Change::PodRemove(uid) => sch::Change::PodRemove(uid),
                    });
                    with(
                        |fw| {
                            for e in fw.update(changes) {
                                $crate::log::warn(&e);
                            }
                        },
                        (),
                    )
                }

                fn cycle(pod: String) -> Vec<wit_scheduler::PreFilterResult> {
                    let pod = match sch::PodInfo::from_json(&pod) {
                        Ok(pod) => pod,
                        Err(e) => {
                            return vec![wit_scheduler::PreFilterResult {
                                plugin: 0,
                                status: status(sch::Status::error(e)),
                                nodes: None,
                            }];
                        }
                    };
                    with(
                        |fw| {
                            fw.cycle(pod)
                                .into_iter()
                                .map(|(plugin, r)| wit_scheduler::PreFilterResult {
                                    plugin,
                                    status: status(r.status),
                                    nodes: r.nodes,
                                })
                                .collect()
                        },
                        Vec::new(),
                    )
                }

                fn filter(nodes: Vec<u32>) -> Vec<wit_scheduler::Rejection> {
                    with(
                        |fw| {
                            fw.filter(&nodes)
                                .into_iter()
                                .map(|r| wit_scheduler::Rejection {
                                    node: r.node,
                                    plugin: r.plugin,
                                    status: status(r.status),
                                })
                                .collect()
                        },
                        Vec::new(),
                    )
                }

                fn filter_without(
                    victims: Vec<String>,
                    nodes: Vec<u32>,
                ) -> Vec<wit_scheduler::Rejection> {
                    with(
                        |fw| {
                            fw.filter_without(&victims, &nodes)
                                .into_iter()
                                .map(|r| wit_scheduler::Rejection {
                                    node: r.node,
                                    plugin: r.plugin,
                                    status: status(r.status),
                                })
                                .collect()
                        },
                        Vec::new(),
                    )
                }

                fn score(nodes: Vec<u32>) -> Result<Vec<wit_scheduler::PluginScores>, String> {
                    with(
                        |fw| {
                            fw.score(&nodes).map(|all| {
                                all.into_iter()
                                    .map(|(plugin, scores)| wit_scheduler::PluginScores {
                                        plugin,
                                        scores,
                                    })
                                    .collect()
                            })
                        },
                        Err("score before plugins".into()),
                    )
                }

                fn reserve(node: u32) -> wit_scheduler::Status {
                    status(with(
                        |fw| fw.reserve(node),
                        sch::Status::error("reserve before plugins"),
                    ))
                }

                fn unreserve(pod_uid: String, node: u32) {
                    with(|fw| fw.unreserve(&pod_uid, node), ())
                }

                fn permit(node: u32) -> wit_scheduler::PermitVerdict {
                    match with(
                        |fw| fw.permit(node),
                        sch::Permit::Deny(sch::Status::error("permit before plugins")),
                    ) {
                        sch::Permit::Allow => wit_scheduler::PermitVerdict::Allow,
                        sch::Permit::Deny(s) => wit_scheduler::PermitVerdict::Deny(status(s)),
                        sch::Permit::Wait(ms) => wit_scheduler::PermitVerdict::Wait(ms),
                    }
                }

                fn allowed() -> Vec<String> {
                    with(|fw| fw.allowed(), Vec::new())
                }
            }

            export!(Export);
        }
    };
}
