//! Splitting one sequence over context-parallel groups of unequal devices: the shard sizes that
//! balance the groups' step times within their memory, by a linear program.
//!
//! Head–tail shards make every group's causal attention work exactly linear in its tokens
//! (`medley_cost::context`), and so are its projections, MLP, Ulysses all-to-alls and activation
//! memory; the keys and values it receives from the others fall as its own shard grows. Each of
//! a group's times is therefore `fixed + per_token · n`, and the split that minimises the slowest
//! group is the linear program: minimise T subject to every time ≤ T, every memory ≤ its
//! capacity, the shards adding up to the sequence and each at least one pair of blocks (HexiSeq,
//! arXiv 2605.07569, solves the same balance with per-device heads on top). It is solved with
//! good_lp's pure-Rust microlp, then rounded to whole pairs of blocks: each group keeps the whole
//! units its share holds, and the few left over go one by one where they leave the slowest group
//! fastest, among the groups that can hold one more.

use good_lp::{Expression, ProblemVariables, Solution, SolverModel, Variable, microlp, variable};
use medley_cost::long_context::HeadTailShards;

use crate::error::PlanError;

/// `fixed + per_token · n` for a group holding a shard of n tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Linear {
    pub fixed: f64,
    pub per_token: f64,
}

impl Linear {
    pub fn at(self, tokens: f64) -> f64 {
        self.fixed + self.per_token * tokens
    }

    fn expression(self, tokens: Variable) -> Expression {
        self.per_token * tokens + self.fixed
    }
}

/// `own(n) + per_next_token · m` for a group holding n tokens before a group holding m: a ring
/// sends every block on but the next group's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NextLinear {
    pub own: Linear,
    pub per_next_token: f64,
}

impl NextLinear {
    pub fn at(self, tokens: f64, next_tokens: f64) -> f64 {
        self.own.at(tokens) + self.per_next_token * next_tokens
    }
}

/// One group's costs as functions of its shard.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupCost {
    /// Seconds that must each fit in the step: a sum of parts that run one after another, or one
    /// entry per part that overlaps the others (a ring's transfers and the attention they feed).
    pub times_s: Vec<Linear>,
    /// Seconds that also depend on the next group's shard, each to fit in the step too.
    pub next_times_s: Vec<NextLinear>,
    /// Bytes on each device of the group (of each stage that shares the split).
    pub memory_bytes: Vec<Linear>,
    /// What one device holds.
    pub capacity_bytes: f64,
}

impl GroupCost {
    /// The slowest of the group's times with a shard of `tokens` before one of `next_tokens`.
    pub fn time_s(&self, tokens: f64, next_tokens: f64) -> f64 {
        let own = self.times_s.iter().map(|time| time.at(tokens));
        let next = self.next_times_s.iter().map(|time| time.at(tokens, next_tokens));
        own.chain(next).fold(0.0, f64::max)
    }

    fn fits(&self, tokens: f64) -> bool {
        self.memory_bytes.iter().all(|memory| memory.at(tokens) <= self.capacity_bytes)
    }
}

/// `count` groups with the same costs, one after another around the ring: a balanced split
/// gives them shards a unit apart at most.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupKind {
    pub cost: GroupCost,
    pub count: u32,
    /// The kinds whose groups follow this kind's around the ring (itself, for all but its last).
    pub next: Vec<usize>,
}

/// The shards of one kind's groups: the first `n_more` hold `units + 1` units, the rest `units`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KindShare {
    pub units: u64,
    pub n_more: u32,
    count: u32,
}

impl KindShare {
    /// Tokens of each of the kind's groups, in order, for `unit`-token units.
    pub fn tokens(self, unit: u64) -> impl Iterator<Item = u64> {
        (0..self.count).map(move |idx| (self.units + u64::from(idx < self.n_more)) * unit)
    }

    /// Units of its fullest group.
    fn most(self) -> u64 {
        self.units + u64::from(self.n_more > 0)
    }

    /// Units of its emptiest group.
    fn fewest(self) -> u64 {
        self.units + u64::from(self.n_more == self.count)
    }

    fn add_one(&mut self) {
        self.n_more += 1;
        if self.n_more == self.count {
            (self.units, self.n_more) = (self.units + 1, 0);
        }
    }

    fn remove_one(&mut self) {
        match self.n_more {
            0 => (self.units, self.n_more) = (self.units - 1, self.count - 1),
            _ => self.n_more -= 1,
        }
    }
}

/// Shard sizes for `groups` over a sequence of `n_tokens`, in whole pairs of `block`-token
/// blocks, that make the slowest group as fast as memory allows.
pub fn split_sequence(groups: &[GroupCost], n_tokens: u64, block: u64) -> Result<HeadTailShards, PlanError> {
    let n = groups.len();
    let kinds: Vec<GroupKind> =
        (0..n).map(|g| GroupKind { cost: groups[g].clone(), count: 1, next: vec![(g + 1) % n] }).collect();
    let unit = 2 * block.max(1);
    let counts = split_by_kind(&kinds, n_tokens, block)?.into_iter().flat_map(|share| share.tokens(unit)).collect();
    Ok(HeadTailShards::new(n_tokens, counts).expect("whole, positive units adding up to the sequence"))
}

/// [`split_sequence`] for groups that come in kinds: one variable a kind, so a thousand groups
/// of four kinds cost a four-variable program. Shards in pairs of `block`-token blocks.
pub fn split_by_kind(kinds: &[GroupKind], n_tokens: u64, block: u64) -> Result<Vec<KindShare>, PlanError> {
    let unit = 2 * block.max(1);
    let n_groups: u64 = kinds.iter().map(|kind| u64::from(kind.count)).sum();
    if n_groups == 0
        || kinds.iter().any(|kind| kind.count == 0)
        || !n_tokens.is_multiple_of(unit)
        || n_tokens / unit < n_groups
    {
        return Err(PlanError::NothingFits(format!(
            "{n_tokens} tokens do not split into {n_groups} head–tail shards of whole {block}-token block pairs"
        )));
    }
    let ideal = solve(kinds, n_tokens as f64, unit as f64)?;
    round_to_units(kinds, &ideal, n_tokens / unit, unit as f64)
}

/// The linear program's tokens per group of each kind, unrounded.
fn solve(kinds: &[GroupKind], n_tokens: f64, unit: f64) -> Result<Vec<f64>, PlanError> {
    let mut variables = ProblemVariables::new();
    let slowest = variables.add(variable().min(0.0));
    let shards: Vec<Variable> = kinds.iter().map(|_| variables.add(variable().min(unit).max(n_tokens))).collect();
    let mut model = variables.minimise(slowest).using(microlp);
    let total: Expression = kinds.iter().zip(&shards).map(|(kind, &shard)| f64::from(kind.count) * shard).sum();
    model.add_constraint(total.eq(n_tokens));
    for (kind, &shard) in kinds.iter().zip(&shards) {
        for time in &kind.cost.times_s {
            model.add_constraint(time.expression(shard).leq(slowest));
        }
        for time in &kind.cost.next_times_s {
            for &next in &kind.next {
                model.add_constraint((time.own.expression(shard) + time.per_next_token * shards[next]).leq(slowest));
            }
        }
        for memory in &kind.cost.memory_bytes {
            model.add_constraint(memory.expression(shard).leq(kind.cost.capacity_bytes));
        }
    }
    let solution = model.solve().map_err(|error| {
        PlanError::NothingFits(format!("no split of {n_tokens} tokens over {} group kinds fits: {error}", kinds.len()))
    })?;
    Ok(shards.iter().map(|&shard| solution.value(shard)).collect())
}

/// `ideal` tokens per group as whole units adding up to `total_units`: the units each ideal
/// holds, then one at a time where the slowest group ends fastest, among those that can hold it.
fn round_to_units(
    kinds: &[GroupKind],
    ideal: &[f64],
    total_units: u64,
    unit: f64,
) -> Result<Vec<KindShare>, PlanError> {
    let mut shares: Vec<KindShare> = kinds
        .iter()
        .zip(ideal)
        .map(|(kind, tokens)| KindShare {
            units: ((tokens / unit + 1e-9).floor() as u64).max(1),
            n_more: 0,
            count: kind.count,
        })
        .collect();
    let held = |shares: &[KindShare]| -> u64 {
        shares.iter().map(|share| share.units * u64::from(share.count) + u64::from(share.n_more)).sum()
    };
    while held(&shares) > total_units {
        let largest = (0..shares.len())
            .filter(|&k| shares[k].units > 1 || shares[k].n_more > 0)
            .max_by_key(|&k| (shares[k].most(), std::cmp::Reverse(k)))
            .expect("at least one unit per group fits the sequence");
        shares[largest].remove_one();
    }
    while held(&shares) < total_units {
        // The slowest group's time if a group of kind `with` gets one more unit (a group whose
        // transfers shrink as its shard grows may be the slowest before it gets one).
        let slowest_with = |with: usize| {
            (0..kinds.len())
                .map(|k| {
                    let with_one = |kind: usize| {
                        let mut share = shares[kind];
                        if kind == with {
                            share.add_one();
                        }
                        share
                    };
                    let share = with_one(k);
                    // A group sends the most before the smallest next shard.
                    let fewest_next = kinds[k].next.iter().map(|&next| with_one(next).fewest()).min().unwrap_or(1);
                    let next_tokens = fewest_next as f64 * unit;
                    let time = |units: u64| kinds[k].cost.time_s(units as f64 * unit, next_tokens);
                    match share.n_more {
                        0 => time(share.units),
                        _ => time(share.units).max(time(share.units + 1)),
                    }
                })
                .fold(0.0, f64::max)
        };
        let next = (0..kinds.len())
            .filter(|&k| kinds[k].cost.fits((shares[k].units + 1) as f64 * unit))
            .min_by(|&a, &b| slowest_with(a).total_cmp(&slowest_with(b)).then(a.cmp(&b)))
            .ok_or_else(|| {
                PlanError::NothingFits(format!(
                    "no group can hold another {unit}-token unit once the split is rounded to whole units"
                ))
            })?;
        shares[next].add_one();
    }
    Ok(shares)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group `speed` times as fast as the reference, with a ring's K/V exchange on `link` (the
    /// share of the others' tokens it receives per second, relative) and `capacity` tokens of
    /// memory.
    fn group(speed: f64, capacity_tokens: f64) -> GroupCost {
        GroupCost {
            times_s: vec![Linear { fixed: 0.001, per_token: 1e-5 / speed }],
            next_times_s: Vec::new(),
            memory_bytes: vec![Linear { fixed: 0.0, per_token: 1.0 }],
            capacity_bytes: capacity_tokens,
        }
    }

    fn slowest(groups: &[GroupCost], shards: &HeadTailShards) -> f64 {
        groups.iter().zip(shards.counts()).map(|(group, &tokens)| group.time_s(tokens as f64, 0.0)).fold(0.0, f64::max)
    }

    #[test]
    fn equal_groups_split_evenly() {
        let groups = vec![group(1.0, 1e9); 4];
        let shards = split_sequence(&groups, 131_072, 128).unwrap();
        assert_eq!(shards.counts(), [32_768; 4]);
    }

    #[test]
    fn faster_groups_take_more_until_memory_stops_them() {
        let shards = split_sequence(&[group(2.0, 1e9), group(1.0, 1e9)], 131_072, 128).unwrap();
        let ratio = shards.counts()[0] as f64 / shards.counts()[1] as f64;
        assert!((ratio - 2.0).abs() < 0.02, "{:?}", shards.counts());
        // The fast group can hold only 40,000 tokens: it gets at most that, the other the rest.
        let capped = split_sequence(&[group(2.0, 40_000.0), group(1.0, 1e9)], 131_072, 128).unwrap();
        assert!(capped.counts()[0] <= 40_000 && capped.counts()[0] > 39_000, "{:?}", capped.counts());
        let err = split_sequence(&[group(1.0, 1000.0), group(1.0, 1000.0)], 131_072, 128).unwrap_err();
        assert!(err.to_string().contains("no split of 131072 tokens"), "{err}");
    }

    #[test]
    fn an_overlapped_ring_balances_against_its_transfers() {
        // Compute grows with the shard; the K/V received (the others' tokens) shrinks with it.
        let n = 65_536.0;
        let ring = |speed: f64, link: f64| GroupCost {
            times_s: vec![
                Linear { fixed: 0.0, per_token: 1e-5 / speed },
                Linear { fixed: n * 2e-6 / link, per_token: -2e-6 / link },
            ],
            next_times_s: Vec::new(),
            memory_bytes: vec![Linear { fixed: 0.0, per_token: 1.0 }],
            capacity_bytes: 1e9,
        };
        let groups = [ring(1.0, 1.0), ring(1.0, 0.05)];
        let shards = split_sequence(&groups, 65_536, 128).unwrap();
        // The slow-linked group takes more of the sequence to receive less of it.
        assert!(shards.counts()[1] > shards.counts()[0], "{:?}", shards.counts());
        let even = HeadTailShards::even(65_536, 2, 128).unwrap();
        assert!(slowest(&groups, &shards) < 0.8 * slowest(&groups, &even));
    }

    #[test]
    fn the_rounded_split_is_within_a_unit_of_the_best_whole_split() {
        // Exhaustive over whole units for three groups of 64 units.
        let groups = [group(3.0, 1e9), group(1.7, 1e9), group(1.0, 1e9)];
        let (n, unit) = (64 * 256u64, 256u64);
        let shards = split_sequence(&groups, n, 128).unwrap();
        let units = n / unit;
        let mut best = f64::INFINITY;
        for a in 1..units {
            for b in 1..units - a {
                let counts = [a * unit, b * unit, (units - a - b) * unit];
                let time = groups
                    .iter()
                    .zip(counts)
                    .map(|(group, tokens)| group.time_s(tokens as f64, 0.0))
                    .fold(0.0, f64::max);
                best = best.min(time);
            }
        }
        let found = slowest(&groups, &shards);
        assert!(found <= best * 1.02, "{found} against the exhaustive {best}: {:?}", shards.counts());
    }
}
