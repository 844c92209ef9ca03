//! The host's side of the imports every world shares, one file per WIT interface:
//! each serves today's interface and forwards the frozen `trellis:plugin@0.1.0` one
//! to it.

use wasmtime::component::{HasSelf, Linker};

use crate::bindings;
use crate::state::PluginState;

mod cluster;
pub(crate) mod controller;
mod log;

/// Adds the shared imports to `linker`: today's (`trellis:core`) and those of
/// `trellis:plugin@0.1.0`, so a component of either contract links.
pub(crate) fn add_to_linker(linker: &mut Linker<PluginState>) -> wasmtime::Result<()> {
    bindings::core::Imports::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |state| {
        state
    })?;
    bindings::plugin_0_1::log::add_to_linker::<PluginState, HasSelf<PluginState>>(
        linker,
        |state| state,
    )?;
    bindings::plugin_0_1::cluster::add_to_linker::<PluginState, HasSelf<PluginState>>(
        linker,
        |state| state,
    )?;
    // Its types are mapped onto today's, whose bindings define no instance under the
    // old name; a component that imports the interface needs one, even empty.
    linker.instance("trellis:plugin/types@0.1.0")?;
    Ok(())
}
