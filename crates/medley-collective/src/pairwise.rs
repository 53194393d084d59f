//! Direct exchanges between pairs of ranks.

use crate::{Buf, Builder, CollectiveError, blocks_of};
use std::ops::Range;

/// All-to-all in n−1 rounds: in round k rank r sends to r+k and receives from r−k, so every rank
/// sends and receives exactly once per round (Thakur et al. 2005's pairwise exchange, for any n).
/// Returns each rank's (input length, output length, result).
pub(crate) fn all_to_all(
    b: &mut Builder,
    matrix: &[Vec<usize>],
) -> Result<Vec<(usize, usize, Range<usize>)>, CollectiveError> {
    let n = matrix.len();
    // Rank r's input holds its messages to 0..n in order; its output those from 0..n in order.
    let inputs: Vec<Vec<Range<usize>>> = matrix.iter().map(|row| blocks_of(row)).collect::<Result<_, _>>()?;
    let outputs: Vec<Vec<Range<usize>>> =
        (0..n).map(|r| blocks_of(&matrix.iter().map(|row| row[r]).collect::<Vec<_>>())).collect::<Result<_, _>>()?;
    for r in 0..n {
        b.copy(r, inputs[r][r].clone(), outputs[r][r].clone());
        for k in 1..n {
            let (to, from) = ((r + k) % n, (r + n - k) % n);
            b.send(r, to, Buf::Input, inputs[r][to].clone());
            b.recv(r, from, outputs[r][from].clone(), false);
        }
    }
    Ok((0..n)
        .map(|r| {
            let (input_len, output_len) =
                (inputs[r].last().map_or(0, |b| b.end), outputs[r].last().map_or(0, |b| b.end));
            (input_len, output_len, 0..output_len)
        })
        .collect())
}

/// The dissemination barrier (Hensgen, Finkel & Manber 1988): in round k rank r signals r+2^k and
/// waits for r−2^k; after ⌈log₂ n⌉ rounds every rank has heard, transitively, from every other.
pub(crate) fn barrier(b: &mut Builder) {
    let n = b.steps.len();
    let mut distance = 1;
    while distance < n {
        for r in 0..n {
            b.steps[r].push(crate::Step::Send { to: (r + distance) % n, buf: Buf::Output, range: 0..0 });
            b.steps[r].push(crate::Step::Recv { from: (r + n - distance) % n, range: 0..0, reduce: false });
        }
        distance <<= 1;
    }
}
