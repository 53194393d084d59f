//! Rank correlation: whether a model orders layouts as measurements do, whatever its scale.

/// Spearman's rank correlation of `a` and `b` (the Pearson correlation of their ranks, ties
/// sharing their mean rank); `None` for fewer than three pairs or where either side is constant.
pub fn spearman(a: &[f64], b: &[f64]) -> Option<f64> {
    assert_eq!(a.len(), b.len(), "spearman takes pairs");
    if a.len() < 3 {
        return None;
    }
    pearson(&ranks(a), &ranks(b))
}

/// Ranks from 1, ties at their mean rank.
fn ranks(values: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&i, &j| values[i].total_cmp(&values[j]));
    let mut ranks = vec![0.0; values.len()];
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && values[order[end]] == values[order[start]] {
            end += 1;
        }
        let mean_rank = (start + end + 1) as f64 / 2.0;
        for &idx in &order[start..end] {
            ranks[idx] = mean_rank;
        }
        start = end;
    }
    ranks
}

fn pearson(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len() as f64;
    let (mean_a, mean_b) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let covariance: f64 = a.iter().zip(b).map(|(x, y)| (x - mean_a) * (y - mean_b)).sum();
    let spread = |values: &[f64], mean: f64| values.iter().map(|v| (v - mean).powi(2)).sum::<f64>().sqrt();
    let scale = spread(a, mean_a) * spread(b, mean_b);
    (scale > 0.0).then(|| covariance / scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_order_is_one_reversed_is_minus_one_whatever_the_scale() {
        let near = |value: Option<f64>, want: f64| value.is_some_and(|value| (value - want).abs() < 1e-12);
        assert!(near(spearman(&[1.0, 2.0, 3.0, 4.0], &[10.0, 200.0, 3000.0, 40000.0]), 1.0));
        assert!(near(spearman(&[1.0, 2.0, 3.0, 4.0], &[4.0, 3.0, 2.0, 1.0]), -1.0));
    }

    #[test]
    fn ties_share_their_mean_rank_and_too_little_data_has_no_correlation() {
        assert_eq!(ranks(&[3.0, 1.0, 3.0, 2.0]), vec![3.5, 1.0, 3.5, 2.0]);
        // d = (0, 0, 1, -1): 1 - 6·2 / (4·15) = 0.8, the textbook formula without ties.
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[1.0, 2.0, 4.0, 3.0]).unwrap() - 0.8).abs() < 1e-12);
        assert_eq!(spearman(&[1.0, 2.0], &[2.0, 1.0]), None);
        assert_eq!(spearman(&[1.0, 1.0, 1.0], &[1.0, 2.0, 3.0]), None);
    }
}
