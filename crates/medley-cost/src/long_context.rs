//! Long-context attention split over devices: context parallelism (CP: each group of devices holds
//! a shard of the sequence, and keys and values travel between the groups, around a ring or as an
//! all-gather) and head parallelism inside a group (HP, Ulysses: an all-to-all gives each device
//! every token of the group's shard for some heads). Shards, token shares and heads may all be
//! uneven, as a mixed fleet needs; volumes follow ../shared/reference/formulas.md ("Long context").
//!
//! Shards are head–tail (zigzag, Megatron-LM's and torchtitan's "headtail"): shard i takes the i-th
//! run of tokens from the front of the sequence and its mirror from the back. Under a causal mask
//! query q attends to q + 1 keys, and q and its mirror N − 1 − q attend to N + 1 together, so a
//! head–tail shard of n tokens computes exactly n·(N + 1)/2 query–key pairs: its attention work is
//! linear in its tokens, whatever its place, which is what lets a planner split a sequence by
//! device speed with a linear program. Contiguous shards instead do work ∝ 2i + 1.

use std::ops::Range;

use medley_spec::ModelSpec;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Why a split of a sequence or of the heads cannot be made.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ContextError {
    #[error("shards of {counts:?} tokens do not add up to the sequence's {n_tokens}")]
    ShardSum { n_tokens: u64, counts: Vec<u64> },
    #[error("shard {shard} holds {tokens} tokens: a head–tail shard needs a positive, even count")]
    OddShard { shard: usize, tokens: u64 },
    #[error("{n_tokens} tokens cannot be split into {n_shards} head–tail shards of whole {block}-token blocks")]
    TooShort { n_tokens: u64, n_shards: usize, block: u64 },
    #[error("{n_devices} devices cannot share {n_heads} attention heads")]
    TooFewHeads { n_devices: usize, n_heads: u32 },
    #[error("query heads {shares:?} per device must be positive and add up to the model's {total}")]
    HeadSum { total: u32, shares: Vec<u32> },
    #[error(
        "query heads {shares:?}: with no more devices than the {n_kv_heads} KV heads, each device holds whole \
         grouped-query units of {unit} query heads"
    )]
    SplitUnit { shares: Vec<u32>, n_kv_heads: u32, unit: u32 },
}

/// Query–key pairs the queries of `positions` compute under a causal mask: query q attends to
/// the q + 1 keys 0..=q.
pub fn causal_pairs(positions: Range<u64>) -> u64 {
    let triangle = |n: u64| n * (n + 1) / 2;
    triangle(positions.end) - triangle(positions.start)
}

/// Pairs (q, k) with q in `queries`, k in `keys` and k ≤ q.
fn pairs_in(queries: Range<u64>, keys: Range<u64>) -> u64 {
    // Queries among the keys see the keys up to themselves; later queries see all of them.
    let among = queries.start.max(keys.start)..queries.end.min(keys.end);
    let diagonal = if among.is_empty() { 0 } else { causal_pairs(among.start - keys.start..among.end - keys.start) };
    let after = queries.end.saturating_sub(queries.start.max(keys.end));
    diagonal + after * (keys.end - keys.start)
}

/// A sequence of `n_tokens` split into head–tail shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadTailShards {
    n_tokens: u64,
    /// Tokens of each shard, in shard order; each even, adding up to `n_tokens`.
    counts: Vec<u64>,
}

impl HeadTailShards {
    /// Shards of `counts` tokens, in order: shard i holds `counts[i] / 2` tokens from the front,
    /// after shard i − 1's, and as many from the back, before shard i − 1's.
    pub fn new(n_tokens: u64, counts: Vec<u64>) -> Result<Self, ContextError> {
        if let Some((shard, &tokens)) = counts.iter().enumerate().find(|(_, tokens)| **tokens == 0 || *tokens % 2 == 1)
        {
            return Err(ContextError::OddShard { shard, tokens });
        }
        if counts.iter().sum::<u64>() != n_tokens {
            return Err(ContextError::ShardSum { n_tokens, counts });
        }
        Ok(HeadTailShards { n_tokens, counts })
    }

    /// `n_shards` equal shards, as Megatron-LM cuts a sequence into 2·cp chunks: `n_tokens` must
    /// be a multiple of 2·n_shards·block.
    pub fn even(n_tokens: u64, n_shards: usize, block: u64) -> Result<Self, ContextError> {
        Self::proportional(n_tokens, &vec![1.0; n_shards], block)
    }

    /// Shards as near `weights`' proportions as whole pairs of `block`-token blocks allow (each
    /// shard at least one pair; largest remainders first, ties to the earlier shard). `n_tokens`
    /// must be a multiple of 2·block.
    pub fn proportional(n_tokens: u64, weights: &[f64], block: u64) -> Result<Self, ContextError> {
        let unit = 2 * block.max(1);
        let units = n_tokens / unit;
        let too_short = || ContextError::TooShort { n_tokens, n_shards: weights.len(), block };
        if weights.is_empty() || !n_tokens.is_multiple_of(unit) || units < weights.len() as u64 {
            return Err(too_short());
        }
        // One unit each, then the rest by weight.
        let spare = units - weights.len() as u64;
        let total: f64 = weights.iter().map(|w| w.max(0.0)).sum();
        let ideal: Vec<f64> = weights
            .iter()
            .map(|w| if total > 0.0 { spare as f64 * w.max(0.0) / total } else { spare as f64 / weights.len() as f64 })
            .collect();
        let mut shares: Vec<u64> = ideal.iter().map(|x| x.floor() as u64).collect();
        let mut order: Vec<usize> = (0..weights.len()).collect();
        order.sort_by(|&a, &b| (ideal[b] - ideal[b].floor()).total_cmp(&(ideal[a] - ideal[a].floor())).then(a.cmp(&b)));
        let left = spare - shares.iter().sum::<u64>();
        for &shard in order.iter().take(left as usize) {
            shares[shard] += 1;
        }
        Self::new(n_tokens, shares.iter().map(|share| (share + 1) * unit).collect())
    }

    pub fn n_tokens(&self) -> u64 {
        self.n_tokens
    }

    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Shard `shard`'s two runs of positions: from the front and from the back.
    pub fn ranges(&self, shard: usize) -> [Range<u64>; 2] {
        let before: u64 = self.counts[..shard].iter().sum::<u64>() / 2;
        let half = self.counts[shard] / 2;
        [before..before + half, self.n_tokens - before - half..self.n_tokens - before]
    }

    /// Query–key pairs shard `shard`'s queries compute under the causal mask: exactly
    /// `tokens · (N + 1) / 2`.
    pub fn pairs(&self, shard: usize) -> u64 {
        self.ranges(shard).into_iter().map(causal_pairs).sum()
    }

    /// Of them, the pairs whose keys are shard `keys`'s: the attention a ring step computes on
    /// the block it received.
    pub fn pairs_between(&self, queries: usize, keys: usize) -> u64 {
        let key_ranges = self.ranges(keys);
        self.ranges(queries)
            .into_iter()
            .flat_map(|q| key_ranges.clone().map(|k| (q.clone(), k)))
            .map(|(q, k)| pairs_in(q, k))
            .sum()
    }
}

/// Query–key pairs of each of `n_shards` contiguous, equal shards (the split without zigzag),
/// for comparison: shard i does work ∝ 2i + 1.
pub fn contiguous_pairs(n_tokens: u64, n_shards: usize) -> Vec<u64> {
    let size = n_tokens / n_shards as u64;
    (0..n_shards as u64)
        .map(|i| {
            let end = if i + 1 == n_shards as u64 { n_tokens } else { (i + 1) * size };
            causal_pairs(i * size..end)
        })
        .collect()
}

/// One device's heads in a head-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShare {
    /// Query heads the device computes attention for.
    pub q_heads: u32,
    /// Key/value heads it holds for them: its grouped-query units' own, or, when the group has
    /// more devices than KV heads, the ones its query heads read (a KV head then lives on several
    /// devices, and its keys and values travel to each).
    pub kv_heads: u32,
}

/// How a group shares the attention heads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadSplit {
    /// Whole grouped-query units (one KV head with its H/H_kv query heads) per device.
    Units(Vec<HeadShare>),
    /// More devices than KV heads: query heads split, each device holding the KV heads they read.
    ReplicatedKv(Vec<HeadShare>),
}

impl HeadSplit {
    pub fn shares(&self) -> &[HeadShare] {
        match self {
            HeadSplit::Units(shares) | HeadSplit::ReplicatedKv(shares) => shares,
        }
    }

    /// Splits `model`'s heads over a group in proportion to `weights`: grouped-query units when
    /// there are at least as many KV heads as devices, else query heads with their KV heads
    /// replicated. Every device gets at least one unit (one query head).
    pub fn proportional(model: &ModelSpec, weights: &[f64]) -> Result<Self, ContextError> {
        let (n_heads, n_kv) = (model.n_heads(), model.n_kv_heads());
        let q_heads = match weights.len() as u32 <= n_kv {
            true => split_whole(n_kv, weights)?.iter().map(|units| units * (n_heads / n_kv)).collect(),
            false => split_whole(n_heads, weights)?,
        };
        Self::from_q_heads(model, &q_heads)
    }

    /// The split that gives device j `q_heads[j]` query heads, in head order: whole grouped-query
    /// units when the group has at most as many devices as KV heads, else with the KV heads each
    /// device's query heads read.
    pub fn from_q_heads(model: &ModelSpec, q_heads: &[u32]) -> Result<Self, ContextError> {
        let (n_heads, n_kv) = (model.n_heads(), model.n_kv_heads());
        let group = n_heads / n_kv;
        if q_heads.contains(&0) || q_heads.iter().map(|&q| u64::from(q)).sum::<u64>() != u64::from(n_heads) {
            return Err(ContextError::HeadSum { total: n_heads, shares: q_heads.to_vec() });
        }
        if q_heads.len() as u32 <= n_kv {
            if q_heads.iter().any(|q| q % group != 0) {
                return Err(ContextError::SplitUnit { shares: q_heads.to_vec(), n_kv_heads: n_kv, unit: group });
            }
            let shares = q_heads.iter().map(|&q| HeadShare { q_heads: q, kv_heads: q / group }).collect();
            return Ok(HeadSplit::Units(shares));
        }
        let mut first = 0;
        let shares = q_heads
            .iter()
            .map(|&q| {
                let kv_heads = (first + q - 1) / group - first / group + 1;
                first += q;
                HeadShare { q_heads: q, kv_heads }
            })
            .collect();
        Ok(HeadSplit::ReplicatedKv(shares))
    }
}

/// `total` whole items over `weights`, at least one each, largest remainders first.
pub fn split_whole(total: u32, weights: &[f64]) -> Result<Vec<u32>, ContextError> {
    if weights.is_empty() || weights.len() as u32 > total {
        return Err(ContextError::TooFewHeads { n_devices: weights.len(), n_heads: total });
    }
    let units = HeadTailShards::proportional(u64::from(total) * 2, weights, 1)?;
    Ok(units.counts().iter().map(|&count| (count / 2) as u32).collect())
}

/// Bytes one device sends and receives in one layer's forward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    pub sent: u64,
    pub received: u64,
}

/// Ulysses' two all-to-alls (Jacobs et al. 2023, arXiv 2309.14509) for device `me` of a group
/// whose devices hold `tokens[j]` tokens of the group's shard for the token-parallel layers and
/// `heads[j]` heads for attention: before attention Q, K and V of its tokens go to the devices
/// holding their heads, and it receives its heads' Q, K and V for the other devices' tokens;
/// after attention the outputs go back. `bytes` per element.
pub fn ulysses_traffic(model: &ModelSpec, tokens: &[u64], heads: &[HeadShare], me: usize, bytes: u64) -> Traffic {
    let head_dim = u64::from(model.head_dim());
    let width = |share: &HeadShare| (u64::from(share.q_heads) + 2 * u64::from(share.kv_heads)) * head_dim;
    let others = |value: &dyn Fn(usize) -> u64| (0..tokens.len()).filter(|&j| j != me).map(value).sum::<u64>();
    let mine = &heads[me];
    // Q, K, V out for the others' heads; the attention output back for the others' query heads.
    let qkv_out = tokens[me] * others(&|j| width(&heads[j]));
    let o_in = tokens[me] * others(&|j| u64::from(heads[j].q_heads) * head_dim);
    // Q, K, V in for my heads from the others' tokens; my heads' output back to them.
    let qkv_in = others(&|j| tokens[j]) * width(mine);
    let o_out = others(&|j| tokens[j]) * u64::from(mine.q_heads) * head_dim;
    Traffic { sent: (qkv_out + o_out) * bytes, received: (qkv_in + o_in) * bytes }
}

/// How keys and values reach the other context-parallel groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvExchange {
    /// Around a ring, overlapping attention on the block at hand (Ring Attention, Liu et al.
    /// arXiv 2310.01889; Megatron-LM `cp_comm_type p2p`).
    Ring,
    /// One all-gather before attention (Megatron-LM `allgather`, Llama 3's long-context training).
    AllGather,
}

/// Keys and values device `me` of group `group` exchanges with the other groups of a context-
/// parallel split for the `kv_heads` it holds. Either way it receives every other group's K/V;
/// around a ring it forwards every block but the next group's, while an all-gather sends its own
/// shard to each other group.
pub fn kv_traffic(
    model: &ModelSpec,
    shards: &HeadTailShards,
    group: usize,
    kv_heads: u32,
    exchange: KvExchange,
    bytes: u64,
) -> Traffic {
    let per_token = kv_bytes_per_token(model, kv_heads, bytes);
    let counts = shards.counts();
    let n_groups = counts.len();
    let own = counts[group];
    let sent_tokens = match exchange {
        KvExchange::Ring if n_groups > 1 => shards.n_tokens() - counts[(group + 1) % n_groups],
        KvExchange::Ring => 0,
        KvExchange::AllGather => own * (n_groups as u64 - 1),
    };
    Traffic { sent: sent_tokens * per_token, received: (shards.n_tokens() - own) * per_token }
}

/// Bytes of one token's keys and values for `kv_heads` heads.
pub fn kv_bytes_per_token(model: &ModelSpec, kv_heads: u32, bytes: u64) -> u64 {
    2 * u64::from(kv_heads) * u64::from(model.head_dim()) * bytes
}

/// Forward FLOPs of the attention core for `q_heads` query heads over a head–tail shard of
/// `shard_tokens` of a sequence of `n_tokens`: QKᵀ and score·V, two FLOPs per multiply-add each,
/// per causal pair (exactly shard·(N + 1)/2 of them, [`HeadTailShards::pairs`]) and head dimension.
pub fn attention_core_flops(model: &ModelSpec, n_tokens: u64, shard_tokens: u64, q_heads: u32) -> f64 {
    2.0 * shard_tokens as f64 * (n_tokens + 1) as f64 * f64::from(q_heads) * f64::from(model.head_dim())
}

/// One device's share of one layer's forward pass in a long-context stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ContextWork {
    /// Tokens it holds for the projections, MLP and norms.
    pub tokens: f64,
    /// Attention-core FLOPs of its heads over its group's shard ([`attention_core_flops`]).
    pub attention_flops: f64,
    /// Seconds of its two Ulysses all-to-alls ([`ulysses_traffic`] on the node's links).
    pub all_to_all_s: f64,
    /// Seconds of bringing the other groups' keys and values ([`kv_traffic`] between groups).
    pub kv_s: f64,
    pub kv_exchange: KvExchange,
}

/// Seconds of one pass of a layer on one device, by what may overlap what.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ContextPass {
    /// Projections, MLP, norms and the all-to-alls, one after another.
    pub serial_s: f64,
    /// The attention core.
    pub attention_s: f64,
    /// The key/value exchange with the other groups.
    pub kv_s: f64,
}

/// One layer of a long-context stage on one device, forward and backward.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ContextLayerTime {
    pub forward: ContextPass,
    pub backward: ContextPass,
    /// Whether the exchange hides under the attention it feeds (a ring passes the next block
    /// while attention runs on this one); an all-gather finishes first.
    pub overlaps: bool,
    /// The weight-gradient matmuls inside `backward` (a zero-bubble schedule's W pass).
    pub weight_grad_s: f64,
}

impl ContextLayerTime {
    /// Seconds of `pass`: its serial part, then attention and the exchange side by side or in turn.
    pub fn pass_s(&self, pass: ContextPass) -> f64 {
        let attention = match self.overlaps {
            true => pass.attention_s.max(pass.kv_s),
            false => pass.attention_s + pass.kv_s,
        };
        pass.serial_s + attention
    }

    /// The forward and the backward pass.
    pub fn total_s(&self) -> f64 {
        self.pass_s(self.forward) + self.pass_s(self.backward)
    }

    /// Sums each linear in the work whose largest is [`ContextLayerTime::total_s`]: every choice
    /// of attention or exchange in the forward and in the backward when they overlap (a maximum
    /// of sums a linear program can bound), else the one sum.
    pub fn pieces_s(&self) -> Vec<f64> {
        let (f, b) = (self.forward, self.backward);
        let serial = f.serial_s + b.serial_s;
        match self.overlaps {
            true => [f.attention_s, f.kv_s]
                .into_iter()
                .flat_map(|forward| [b.attention_s, b.kv_s].map(|backward| serial + forward + backward))
                .collect(),
            false => vec![serial + f.attention_s + f.kv_s + b.attention_s + b.kv_s],
        }
    }
}

#[cfg(test)]
mod tests {
    use medley_spec::catalog_model;

    use super::*;

    #[test]
    fn zigzag_balances_the_causal_work_exactly() {
        let shards = HeadTailShards::even(4096, 4, 64).unwrap();
        let pairs: Vec<u64> = (0..4).map(|i| shards.pairs(i)).collect();
        assert!(pairs.iter().all(|&p| p == pairs[0]), "{pairs:?}");
        assert_eq!(pairs.iter().sum::<u64>(), causal_pairs(0..4096));
        assert_eq!(shards.ranges(1), [512..1024, 3072..3584]);
        // Uneven shards: work stays exactly tokens · (N + 1) / 2.
        let uneven = HeadTailShards::new(4096, vec![2048, 1024, 512, 512]).unwrap();
        for (i, &tokens) in uneven.counts().iter().enumerate() {
            assert_eq!(uneven.pairs(i) * 2, tokens * 4097, "shard {i}");
        }
        // Contiguous shards do work ∝ 2i + 1 (up to the diagonal's share).
        let contiguous = contiguous_pairs(4096, 4);
        assert!(contiguous[3] > 6 * contiguous[0], "{contiguous:?}");
        assert_eq!(contiguous.iter().sum::<u64>(), causal_pairs(0..4096));
    }

    #[test]
    fn pairs_between_shards_add_up_to_each_shards_pairs() {
        let shards = HeadTailShards::new(4096, vec![2048, 1024, 512, 512]).unwrap();
        for queries in 0..4 {
            let total: u64 = (0..4).map(|keys| shards.pairs_between(queries, keys)).sum();
            assert_eq!(total, shards.pairs(queries), "shard {queries}");
        }
        // Brute force on a short sequence.
        let small = HeadTailShards::new(24, vec![8, 12, 4]).unwrap();
        for (queries, keys) in (0..3).flat_map(|q| (0..3).map(move |k| (q, k))) {
            let expected = small
                .ranges(queries)
                .into_iter()
                .flatten()
                .flat_map(|q| small.ranges(keys).into_iter().flatten().filter(move |&k| k <= q))
                .count() as u64;
            assert_eq!(small.pairs_between(queries, keys), expected, "{queries} × {keys}");
        }
    }

    #[test]
    fn proportional_shards_are_whole_blocks_near_their_weights() {
        let shards = HeadTailShards::proportional(131_072, &[2.0, 1.0, 1.0], 128).unwrap();
        assert_eq!(shards.counts().iter().sum::<u64>(), 131_072);
        assert!(shards.counts().iter().all(|count| count % 256 == 0), "{:?}", shards.counts());
        assert_eq!(shards.counts()[0], 65_536);
        let err = HeadTailShards::proportional(1000, &[1.0, 1.0], 128).unwrap_err();
        assert!(err.to_string().contains("1000 tokens"), "{err}");
        assert!(HeadTailShards::new(10, vec![5, 5]).is_err());
        assert!(HeadTailShards::new(10, vec![4, 4]).is_err());
    }

    #[test]
    fn heads_keep_grouped_query_units_whole_or_replicate_kv() {
        let model = catalog_model("llama3-8b").unwrap(); // 32 query heads, 8 KV heads
        let units = HeadSplit::proportional(&model, &[3.0, 1.0]).unwrap();
        assert_eq!(
            units,
            HeadSplit::Units(vec![HeadShare { q_heads: 24, kv_heads: 6 }, HeadShare { q_heads: 8, kv_heads: 2 }])
        );
        let replicated = HeadSplit::proportional(&model, &[1.0; 16]).unwrap();
        let HeadSplit::ReplicatedKv(shares) = &replicated else { panic!("{replicated:?}") };
        assert!(shares.iter().all(|share| *share == HeadShare { q_heads: 2, kv_heads: 1 }), "{shares:?}");
        // Uneven query heads may straddle two KV heads' groups.
        let straddling = HeadSplit::proportional(&model, &[3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]).unwrap();
        let total: u32 = straddling.shares().iter().map(|share| share.q_heads).sum();
        assert_eq!(total, 32);
        assert!(straddling.shares().iter().any(|share| share.kv_heads == 2), "{straddling:?}");
        assert!(HeadSplit::proportional(&model, &[1.0; 33]).is_err());
        let err = HeadSplit::from_q_heads(&model, &[18, 14]).unwrap_err().to_string();
        assert!(err.contains("units of 4 query heads"), "{err}");
        assert!(HeadSplit::from_q_heads(&model, &[16, 8]).unwrap_err().to_string().contains("add up to"));
    }

    #[test]
    fn even_volumes_equal_the_closed_forms() {
        let model = catalog_model("llama3-8b").unwrap();
        let (d, d_kv, b) = (model.q_width(), model.kv_width(), 2u64);
        let n = 131_072u64;
        for p in [2usize, 4, 8] {
            // Ulysses over p devices holding the whole sequence: (P − 1)/P · (N/P) · (2d + 2d_kv) · b.
            let heads = HeadSplit::proportional(&model, &vec![1.0; p]).unwrap();
            let tokens = vec![n / p as u64; p];
            let traffic = ulysses_traffic(&model, &tokens, heads.shares(), 0, b);
            let closed = (p as u64 - 1) * (n / p as u64) * (2 * d + 2 * d_kv) * b / p as u64;
            assert_eq!(traffic.sent, closed, "ulysses p={p}");
            assert_eq!(traffic.received, closed, "ulysses p={p}");
            // Ring and all-gather of K/V over p groups: (P − 1) · (N/P) · 2·d_kv · b each way.
            let shards = HeadTailShards::even(n, p, 128).unwrap();
            let closed = (p as u64 - 1) * (n / p as u64) * 2 * d_kv * b;
            for exchange in [KvExchange::Ring, KvExchange::AllGather] {
                let traffic = kv_traffic(&model, &shards, 1, model.n_kv_heads(), exchange, b);
                assert_eq!(traffic, Traffic { sent: closed, received: closed }, "{exchange:?} p={p}");
            }
        }
        // USP 2-D, u-way Ulysses inside r ring groups: the ring part is (r − 1)/r · N · 2·d_kv/u · b.
        let (u, r) = (4u64, 2usize);
        let shards = HeadTailShards::even(n, r, 128).unwrap();
        let traffic = kv_traffic(&model, &shards, 0, model.n_kv_heads() / u as u32, KvExchange::Ring, b);
        assert_eq!(traffic.received, (r as u64 - 1) * n / r as u64 * 2 * d_kv / u * b);
    }

    #[test]
    fn attention_flops_follow_the_pairs() {
        let model = catalog_model("llama3-8b").unwrap();
        let n = 8192;
        // About 2·N²·d forward for the full causal sequence.
        let flops = attention_core_flops(&model, n, n, model.n_heads());
        let closed = 2.0 * (n as f64).powi(2) * model.q_width() as f64;
        assert!((flops / closed - 1.0).abs() < 1e-3, "{flops} vs {closed}");
        // Each uneven head–tail shard's FLOPs are four per pair, head and head dimension.
        let shards = HeadTailShards::new(n, vec![4096, 2048, 1536, 512]).unwrap();
        for (shard, &tokens) in shards.counts().iter().enumerate() {
            let from_pairs = 4.0 * shards.pairs(shard) as f64 * 3.0 * f64::from(model.head_dim());
            assert_eq!(attention_core_flops(&model, n, tokens, 3), from_pairs, "shard {shard}");
        }
    }
}
