//! Traces that the simulator and the runtime both use, so that neither engine depends on the
//! other: [`BandwidthTrace`]s say what fraction of a shared link's bandwidth is left over time
//! (the simulator's inter-node links, the runtime's emulated pipeline links), and [`Timeline`]
//! writes a Chrome/Perfetto trace of either engine's step, in one format, so a simulated and a
//! measured step open side by side.

pub mod bandwidth;
pub mod timeline;

pub use bandwidth::{BandwidthTrace, TraceCursor, TraceError, TraceWalker};
pub use timeline::Timeline;
