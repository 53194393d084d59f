//! Text for people: tables and the words and figures in them.

use comfy_table::presets::UTF8_BORDERS_ONLY;
use comfy_table::{Cell, CellAlignment, Table};

pub use crate::seconds;

/// A table with this header, in the house's border style.
pub fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header(header.iter().map(Cell::new));
    table
}

/// A cell aligned right, as figures are.
pub fn right(text: impl ToString) -> Cell {
    Cell::new(text.to_string()).set_alignment(CellAlignment::Right)
}

/// `1 step`, `3 steps`, `2 micro-batches`, `4 pipeline boundaries`: a count with its noun in
/// the right number.
pub fn count(n: usize, noun: &str) -> String {
    count_words(&n.to_string(), n, noun)
}

/// `figure noun` with the noun in the number `n` asks for: `8/4 micro-batches`.
pub fn count_words(figure: &str, n: usize, noun: &str) -> String {
    if n == 1 {
        return format!("{figure} {noun}");
    }
    let plural = match noun.strip_suffix('y') {
        Some(stem) if !stem.ends_with(['a', 'e', 'o', 'u']) => format!("{stem}ies"),
        _ if ["s", "x", "ch", "sh"].iter().any(|end| noun.ends_with(end)) => format!("{noun}es"),
        _ => format!("{noun}s"),
    };
    format!("{figure} {plural}")
}

/// A large count in words of three digits: `70.6B`, `1.62M`, `2,048`.
pub fn quantity(n: f64) -> String {
    match n {
        n if n >= 1e12 => format!("{:.2}T", n / 1e12),
        n if n >= 1e9 => format!("{:.1}B", n / 1e9),
        n if n >= 1e6 => format!("{:.2}M", n / 1e6),
        n => {
            let digits = format!("{:.0}", n);
            let mut grouped = String::new();
            for (idx, digit) in digits.chars().enumerate() {
                if idx > 0 && (digits.len() - idx).is_multiple_of(3) {
                    grouped.push(',');
                }
                grouped.push(digit);
            }
            grouped
        }
    }
}

/// `12.5%`.
pub fn percent(fraction: f64) -> String {
    format!("{:.1}%", 100.0 * fraction)
}

/// `1.25×`: how many times one quantity is another.
pub fn times(ratio: f64) -> String {
    format!("{ratio:.2}×")
}
