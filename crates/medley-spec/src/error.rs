//! Errors for every way a spec can be wrong, each naming where and what to do.

use std::fmt::{self, Write as _};

/// Where a piece of text came from: a file path, or a label such as `--cluster`.
pub type Source = String;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SpecError {
    /// `message` is a TOML or JSON parser's, which may quote the text.
    #[error("{}:{line}:{column}: {}", echo(.source_name), echo(.message))]
    Syntax { source_name: Source, line: usize, column: usize, message: String },
    /// `message` echoes user text through [`echo`] where it quotes any.
    #[error("{}: field `{}`: {message}", echo(.source_name), echo(.field))]
    Field { source_name: Source, field: String, message: String },
    #[error(
        "{}: medley cannot represent this model ({}); it refuses rather than misread its size and cost",
        echo(.source_name),
        .reasons.join("; ")
    )]
    Unrepresentable { source_name: Source, reasons: Vec<String> },
    #[error("unknown {kind} `{}`{}", echo(.name), did_you_mean(.close))]
    Unknown { kind: &'static str, name: String, close: Vec<String> },
}

fn did_you_mean(close: &[String]) -> String {
    if close.is_empty() { String::new() } else { format!("; did you mean {}?", close.join(", ")) }
}

impl SpecError {
    pub(crate) fn field(source: &str, field: impl Into<String>, message: impl fmt::Display) -> Self {
        SpecError::Field { source_name: source.to_string(), field: field.into(), message: message.to_string() }
    }

    /// A TOML or JSON parse failure, located by byte offset in `text`.
    pub(crate) fn syntax(source: &str, text: &str, offset: Option<usize>, message: &str) -> Self {
        let (line, column) = offset.map_or((1, 1), |at| line_column(text, at));
        SpecError::Syntax { source_name: source.to_string(), line, column, message: message.trim().to_string() }
    }

    pub(crate) fn from_toml(source: &str, text: &str, err: &toml::de::Error) -> Self {
        Self::syntax(source, text, err.span().map(|span| span.start), err.message())
    }
}

/// One-based line and column of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |tail| tail.chars().count()) + 1;
    (line, column)
}

/// The most characters of a user's text that a message echoes.
pub const MAX_ECHO_CHARS: usize = 200;

/// User-given text (a name, a path, a value, a key) as a message echoes it: control and
/// bidirectional-override characters escaped (`\u{1b}`), so that no input can send terminal
/// escapes or reorder what is printed, and at most [`MAX_ECHO_CHARS`] characters, cut with an
/// ellipsis and the text's length said. Every echo of user text goes through it.
pub fn echo(text: &str) -> Echo<'_> {
    Echo(text)
}

/// User-given text, displayed as [`echo`] says.
pub struct Echo<'a>(&'a str);

impl fmt::Display for Echo<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for ch in self.0.chars().take(MAX_ECHO_CHARS) {
            let reorders = matches!(ch, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
            if ch.is_control() || reorders {
                write!(f, "{}", ch.escape_default())?;
            } else {
                f.write_char(ch)?;
            }
        }
        let n_chars = self.0.chars().count();
        if n_chars > MAX_ECHO_CHARS {
            write!(f, "… ({n_chars} characters)")?;
        }
        Ok(())
    }
}

/// The longest name a spec may give a model or device.
const MAX_NAME_CHARS: usize = 200;

/// A name medley prints: at most 200 characters and no control characters, so that a file's
/// name (a HuggingFace `_name_or_path`, say) cannot smuggle terminal escape sequences into output.
pub(crate) fn check_name(source: &str, field: &str, name: &str) -> Result<(), SpecError> {
    if name.chars().count() > MAX_NAME_CHARS {
        return Err(SpecError::field(source, field, format!("must be at most {MAX_NAME_CHARS} characters")));
    }
    if name.chars().any(char::is_control) {
        return Err(SpecError::field(source, field, "must not contain control characters (such as terminal escapes)"));
    }
    Ok(())
}

/// Names from `candidates` within a small edit distance of `name`, closest first.
pub(crate) fn close_names<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Vec<String> {
    let name = name.to_ascii_lowercase();
    let mut scored: Vec<(f64, &str)> =
        candidates
            .map(|candidate| {
                let lower = candidate.to_ascii_lowercase();
                let score = strsim::jaro_winkler(&name, &lower)
                    .max(if lower.contains(&name) || name.contains(&lower) { 0.9 } else { 0.0 });
                (score, candidate)
            })
            .filter(|(score, _)| *score >= 0.75)
            .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    scored.dedup_by(|a, b| a.1 == b.1);
    scored.into_iter().take(4).map(|(_, name)| name.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_column_counts_from_one() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
    }

    #[test]
    fn echoes_escape_control_characters_and_cut_long_text() {
        assert_eq!(echo("h100-sxm").to_string(), "h100-sxm");
        assert_eq!(echo("2x\u{1b}[31mh100\n").to_string(), "2x\\u{1b}[31mh100\\n");
        assert_eq!(echo("é\u{202e}").to_string(), "é\\u{202e}");
        let long = echo(&"a".repeat(100_000)).to_string();
        assert_eq!(long, format!("{}… (100000 characters)", "a".repeat(MAX_ECHO_CHARS)));
    }

    #[test]
    fn close_names_suggests_near_misses() {
        let names = ["h100-sxm", "h200", "a100-80gb", "mi300x"];
        let close = close_names("h10", names.iter().copied());
        assert_eq!(close.first().map(String::as_str), Some("h100-sxm"));
        assert!(close_names("zzzz", names.iter().copied()).is_empty());
    }
}
