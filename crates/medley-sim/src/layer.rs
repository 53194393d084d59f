//! One long-context layer's device programs ([`medley_schedule::long_context_layer`]) executed on the
//! event core: every device runs its compute and communication streams from time 0, its
//! transfers are flows over the layer's own ports, max-min fair where they share one, and a pass
//! ends when its device's streams have both run to their ends.

use medley_cost::comm;
use medley_schedule::long_context_layer::{DeviceStreams, LayerOp, Tag, Waiting, Work};
use medley_spec::{BridgeMode, Cluster, DeviceSlot};

use crate::events::{Channels, EventQueue};

use crate::links::{Endpoint, SharedLinks};
use crate::network::{DrainAt, Network};
use crate::ns;

/// One pass of one layer on one device, simulated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevicePass {
    /// When the device finished its part of the layer.
    pub end_ns: u64,
    pub compute_ns: u64,
    /// Time blocked on its group's all-to-alls.
    pub all_to_all_wait_ns: u64,
    /// Time blocked on keys and values from the other groups (what attention did not hide).
    pub kv_wait_ns: u64,
    pub sent_bytes: u64,
    pub received_bytes: u64,
}

/// A stretch of a device's compute stream: computing `name`, or waiting for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseSpan {
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: &'static str,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    /// Runs a device's stream (0: compute, 1: communication) as far as it goes.
    Run(usize, usize),
    Drained {
        flow: usize,
        version: u64,
    },
    Deliver {
        from: usize,
        to: usize,
    },
}

/// Where one stream of one device stands.
#[derive(Clone, Copy, Debug, Default)]
struct StreamState {
    cursor: usize,
    /// Since when it has waited, while it waits for a message or a count.
    blocked_since: Option<u64>,
    /// Whether a run to check again is already on its way.
    woken: bool,
}

/// Runs `device`'s waiting streams again, to check what they wait for: once per wait, so that no
/// stream runs twice at once.
fn wake(events: &mut EventQueue<Event>, states: &mut [StreamState; 2], device: usize, now: u64) {
    for (stream, state) in states.iter_mut().enumerate() {
        if state.blocked_since.is_some() && !std::mem::replace(&mut state.woken, true) {
            events.push(now, Event::Run(device, stream));
        }
    }
}

/// Runs the devices' programs (`slots`' devices of `cluster`) from time 0, each compute
/// operation taking `work_ns(device, work)`: each device's pass and its compute stream's phases.
pub(crate) fn run_layer(
    slots: &[DeviceSlot],
    cluster: &Cluster,
    programs: &[DeviceStreams],
    element_bytes: f64,
    work_ns: impl Fn(usize, Work) -> u64,
) -> (Vec<DevicePass>, Vec<Vec<PhaseSpan>>) {
    let mut network: Network<(usize, usize, u64)> = Network::new();
    let links = SharedLinks::new(cluster, &mut network);
    let endpoints: Vec<Endpoint> = slots.iter().map(|&slot| links.endpoint(cluster, &[slot])).collect();
    let streams = |device: usize| [&programs[device].compute, &programs[device].comm];
    let bytes_of = |elems: usize| elems as f64 * element_bytes;
    let mut passes = vec![DevicePass::default(); programs.len()];
    let mut phases: Vec<Vec<PhaseSpan>> = vec![Vec::new(); programs.len()];
    let mut states = vec![[StreamState::default(); 2]; programs.len()];
    let mut delivered = vec![vec![0u32; programs.len()]; programs.len()];
    let mut counted = vec![[0u32; 2]; programs.len()];
    let mut channels: Channels<f64> = Channels::default();
    let start = |network: &mut Network<(usize, usize, u64)>, drains: &mut Vec<DrainAt>, now, from, to, bytes| {
        let link = comm::lane_link(cluster, slots[from], slots[to], BridgeMode::DeviceDirect);
        let path = links.path(cluster, &endpoints[from], &endpoints[to]);
        let latency_ns = ns(link.latency_us * 1e-6);
        network.start(now, path, link.gb_s, bytes, (from, to, latency_ns), drains);
    };
    let mut events = EventQueue::default();
    for device in 0..programs.len() {
        events.push(0, Event::Run(device, 0));
        events.push(0, Event::Run(device, 1));
    }
    let mut drains = Vec::new();
    while let Some((now, event)) = events.pop() {
        match event {
            Event::Drained { flow, version } => {
                if network.is_current(flow, version) {
                    let (from, to, latency_ns) = network.finish(now, flow, &mut drains);
                    events.push(now + latency_ns, Event::Deliver { from, to });
                    if let Some(bytes) = channels.finished(from, to) {
                        start(&mut network, &mut drains, now, from, to, bytes);
                    }
                }
            }
            Event::Deliver { from, to } => {
                delivered[from][to] += 1;
                wake(&mut events, &mut states[to], to, now);
            }
            Event::Run(device, stream) => {
                let pass = &mut passes[device];
                let ops = streams(device)[stream];
                let state = &mut states[device][stream];
                state.woken = false;
                let mut marked = false;
                while let Some(&op) = ops.get(state.cursor) {
                    match op {
                        LayerOp::Compute(work) => {
                            let ns = work_ns(device, work);
                            if stream == 0 {
                                let span = PhaseSpan { start_ns: now, end_ns: now + ns, name: work.name() };
                                add_phase(&mut phases[device], span);
                            }
                            pass.compute_ns += ns;
                            state.cursor += 1;
                            events.push(now + ns, Event::Run(device, stream));
                            break;
                        }
                        LayerOp::Send { to, elems } => {
                            let bytes = bytes_of(elems);
                            if let Some(bytes) = channels.offer(device, to, bytes) {
                                start(&mut network, &mut drains, now, device, to, bytes);
                            }
                            pass.sent_bytes += bytes as u64;
                        }
                        LayerOp::Recv { from, waiting } => {
                            let count = &mut delivered[from][device];
                            if *count == 0 {
                                state.blocked_since.get_or_insert(now);
                                break;
                            }
                            *count -= 1;
                            let waited = state.blocked_since.take().map_or(0, |since| now - since);
                            match (stream, waiting) {
                                (0, Waiting::AllToAll) => pass.all_to_all_wait_ns += waited,
                                (0, Waiting::KeysValues) => pass.kv_wait_ns += waited,
                                _ => {}
                            }
                            if stream == 0 && waited > 0 {
                                let span = PhaseSpan { start_ns: now - waited, end_ns: now, name: waiting.name() };
                                add_phase(&mut phases[device], span);
                            }
                        }
                        LayerOp::Mark(tag) => {
                            counted[device][tag as usize] += 1;
                            marked = true;
                        }
                        LayerOp::Await { tag, count } => {
                            if counted[device][tag as usize] < count {
                                state.blocked_since.get_or_insert(now);
                                break;
                            }
                            let waited = state.blocked_since.take().map_or(0, |since| now - since);
                            if stream == 0 && tag == Tag::KvMessage {
                                pass.kv_wait_ns += waited;
                                let name = Waiting::KeysValues.name();
                                add_phase(&mut phases[device], PhaseSpan { start_ns: now - waited, end_ns: now, name });
                            }
                        }
                    }
                    state.cursor += 1;
                }
                if state.cursor == ops.len() {
                    pass.end_ns = pass.end_ns.max(now);
                }
                if marked {
                    wake(&mut events, &mut states[device], device, now);
                }
            }
        }
        for DrainAt { flow, version, at_ns } in drains.drain(..) {
            events.push(at_ns, Event::Drained { flow, version });
        }
    }
    // Bytes in: every device's sends, by receiver.
    for (device, program) in programs.iter().enumerate() {
        for op in program.compute.iter().chain(&program.comm) {
            if let LayerOp::Send { to, elems } = *op {
                passes[to].received_bytes += bytes_of(elems) as u64;
            }
        }
        debug_assert!(
            (0..2).all(|stream| states[device][stream].cursor == streams(device)[stream].len()),
            "a device's streams ran to their ends"
        );
    }
    (passes, phases)
}

/// Appends `span`, or extends the last span when it continues it under the same name.
fn add_phase(phases: &mut Vec<PhaseSpan>, span: PhaseSpan) {
    match phases.last_mut() {
        Some(last) if last.name == span.name && last.end_ns == span.start_ns => last.end_ns = span.end_ns,
        _ => phases.push(span),
    }
}
