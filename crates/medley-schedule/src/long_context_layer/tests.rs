use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

use LayerStep as S;

fn check_steps(pass: LayerPass, kv_exchange: KvExchange, recompute: Recompute, expected: &[LayerStep]) {
    assert_eq!(layer_steps(pass, kv_exchange, recompute), expected, "{pass:?} {kv_exchange:?} {recompute:?}");
}

const FORWARD: [LayerStep; 5] = [
    S::Matmuls(Matmuls::QkvForward),
    S::AllToAll(AllToAll::QkvToHeads),
    S::KeysValues { copies: 1, attention: AttentionWork::Forward },
    S::AllToAll(AllToAll::OutputToTokens),
    S::Matmuls(Matmuls::OutputMlpForward),
];

#[test]
fn the_forward_is_the_same_for_every_exchange_and_recomputation() {
    for kv_exchange in [KvExchange::Ring, KvExchange::AllGather] {
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            check_steps(LayerPass::Forward, kv_exchange, recompute, &FORWARD);
        }
    }
}

#[test]
fn backwards_reverse_the_forward_and_recompute_what_was_dropped() {
    let head = [S::Matmuls(Matmuls::MlpOutputBackward), S::AllToAll(AllToAll::OutputGradToHeads)];
    let tail = [S::AllToAll(AllToAll::QkvGradToTokens), S::Matmuls(Matmuls::QkvBackward)];
    let backward = |recomputed| AttentionWork::Backward { recomputed };
    let gathered = |recomputed| [S::Attention(backward(recomputed)), S::KvGradients];
    let ring = |recomputed| [S::KeysValues { copies: 2, attention: backward(recomputed) }];
    let again = [S::KeysValues { copies: 1, attention: AttentionWork::None }];
    let cases: [(KvExchange, Recompute, Vec<LayerStep>); 6] = [
        (KvExchange::Ring, Recompute::None, [&head[..], &ring(false), &tail].concat()),
        (KvExchange::Ring, Recompute::Selective, [&head[..], &ring(true), &tail].concat()),
        (KvExchange::Ring, Recompute::Full, [&FORWARD[..], &head, &ring(false), &tail].concat()),
        (KvExchange::AllGather, Recompute::None, [&head[..], &gathered(false), &tail].concat()),
        (KvExchange::AllGather, Recompute::Selective, [&head[..], &again, &gathered(true), &tail].concat()),
        (KvExchange::AllGather, Recompute::Full, [&FORWARD[..], &head, &gathered(false), &tail].concat()),
    ];
    for (kv_exchange, recompute, expected) in cases {
        check_steps(LayerPass::Backward, kv_exchange, recompute, &expected);
    }
}

fn share(q_heads: u32, kv_heads: u32) -> HeadShare {
    HeadShare { q_heads, kv_heads }
}

/// Per (from, to) pair of devices: a value.
type PerPair<T> = BTreeMap<(usize, usize), T>;

/// Per (from, to): elements and messages sent, and receives posted.
fn traffic(programs: &[DeviceStreams]) -> (PerPair<(usize, usize)>, PerPair<usize>) {
    let (mut sent, mut received) = (BTreeMap::new(), BTreeMap::new());
    for (device, program) in programs.iter().enumerate() {
        for op in program.compute.iter().chain(&program.comm) {
            match *op {
                LayerOp::Send { to, elems } => {
                    let entry = sent.entry((device, to)).or_insert((0, 0));
                    *entry = (entry.0 + elems, entry.1 + 1);
                }
                LayerOp::Recv { from, .. } => *received.entry((from, device)).or_insert(0) += 1,
                _ => {}
            }
        }
    }
    (sent, received)
}

#[test]
fn an_uneven_layer_sends_what_its_counts_say_and_every_message_is_received() {
    // Two groups of two devices, uneven tokens and heads (three query heads and one, one KV head
    // each), head dim 2.
    let heads = [share(3, 1), share(1, 1)];
    let groups = vec![(6, vec![4, 2]), (2, vec![1, 1])];
    let shape = LayerShape::new(2, groups, &heads, KvExchange::Ring, Recompute::None).unwrap();
    assert_eq!(shape.all_to_all_counts(0, AllToAll::QkvToHeads), [[4 * 5 * 2, 4 * 3 * 2], [2 * 5 * 2, 2 * 3 * 2]]);
    assert_eq!(shape.all_to_all_counts(0, AllToAll::OutputGradToHeads), [[4 * 3 * 2, 4 * 2], [2 * 3 * 2, 2 * 2]]);
    assert_eq!(shape.lane_counts(1, 2), [6 * 2 * 2 * 2, 2 * 2 * 2 * 2]);
    let forward = device_programs(&shape, LayerPass::Forward).unwrap();
    let (sent, received) = traffic(&forward);
    // Group 0's all-to-alls: member 0 sends its tokens' Q/K/V of member 1's heads, then its
    // heads' outputs for member 1's tokens; its keys and values go round its lane, to device 2.
    assert_eq!(sent[&(0, 1)].0, 4 * 3 * 2 + 2 * 3 * 2);
    assert_eq!(sent[&(0, 2)].0, 6 * 2 * 2);
    assert_eq!(sent.keys().collect::<Vec<_>>(), received.keys().collect::<Vec<_>>());
    assert!(sent.iter().all(|(pair, &(_, messages))| received[pair] == messages), "{sent:?} {received:?}");
}

#[test]
fn the_all_gathers_attention_waits_for_the_last_block_and_the_rings_for_each() {
    let heads = [share(2, 1)];
    let groups = vec![(4, vec![4]), (4, vec![4]), (2, vec![2])];
    let awaits = |kv_exchange| {
        let shape = LayerShape::new(2, groups.clone(), &heads, kv_exchange, Recompute::None).unwrap();
        let programs = device_programs(&shape, LayerPass::Forward).unwrap();
        let compute = &programs[0].compute;
        let attention = compute.iter().filter(|op| matches!(op, LayerOp::Compute(Work::Attention { .. }))).count();
        let counts: Vec<u32> = compute
            .iter()
            .filter_map(|op| match op {
                LayerOp::Await { tag: Tag::KvMessage, count } => Some(*count),
                _ => None,
            })
            .collect();
        (attention, counts, programs[0].comm.iter().filter(|op| **op == LayerOp::Mark(Tag::KvMessage)).count())
    };
    let (attention, ring, messages) = awaits(KvExchange::Ring);
    assert_eq!((attention, ring), (messages + 1, (1..=messages as u32).collect::<Vec<_>>()));
    let (attention, gather, messages) = awaits(KvExchange::AllGather);
    assert_eq!((attention, gather), (messages + 1, vec![messages as u32]));
}

#[test]
fn groups_that_split_the_heads_apart_are_refused() {
    let heads = [share(2, 1), share(2, 1)];
    let refused = LayerShape::new(2, vec![(4, vec![2, 2]), (4, vec![4])], &heads, KvExchange::Ring, Recompute::None);
    assert_eq!(refused, Err(LayerError::HeadSplitsDiffer));
}

proptest! {
    /// Any groups, tokens and heads: every send has its receive, every await its mark, and the
    /// backward moves twice the forward's key/value bytes around a ring.
    #[test]
    fn every_layer_lowers_to_matched_messages_and_marks(
        device_tokens in prop::collection::vec(prop::collection::vec(1usize..40, 2..=2), 1..5),
        q_heads in prop::collection::vec(1u32..4, 2..=2),
        ring in any::<bool>(),
        recompute in prop::sample::select(vec![Recompute::None, Recompute::Selective, Recompute::Full]),
    ) {
        let kv_exchange = if ring { KvExchange::Ring } else { KvExchange::AllGather };
        let heads: Vec<HeadShare> = q_heads.iter().map(|&q| share(q, 1)).collect();
        let groups = device_tokens.iter().map(|tokens| (tokens.iter().sum(), tokens.clone())).collect();
        let shape = LayerShape::new(4, groups, &heads, kv_exchange, recompute).unwrap();
        for pass in [LayerPass::Forward, LayerPass::Backward] {
            let programs = device_programs(&shape, pass).unwrap();
            let (sent, received) = traffic(&programs);
            prop_assert!(sent.iter().all(|(pair, &(_, messages))| received.get(pair) == Some(&messages)));
            prop_assert_eq!(sent.len(), received.len());
            for program in &programs {
                let marks = |tag| program.compute.iter().chain(&program.comm).filter(|op| **op == LayerOp::Mark(tag)).count() as u32;
                for op in program.compute.iter().chain(&program.comm) {
                    if let LayerOp::Await { tag, count } = *op {
                        prop_assert!(count <= marks(tag));
                    }
                }
            }
        }
    }
}
