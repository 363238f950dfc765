//! kvgate-config: the one validation error type of every kvgate configuration (gateway, policy,
//! engine, mock, sim, replay; the command line, the YAML file, the Rust builder and the Python
//! package all report through it).
//!
//! A [`FieldError`] names the field by its path (its key in the YAML file, e.g.
//! `routing.cache_threshold` or `models.llama.cache_threshold`), the command-line flag that sets
//! it, the value given and what is allowed. [`ValidationErrors`] carries every problem found, so a
//! user fixes them all in one round. [`Checks`] collects them with the common range checks (NaN
//! and infinities are never in range). [`error_chain`] is the one rendering of an error with its
//! sources on one line, for messages that name a failed exchange (the gateway's, the mock
//! engines', the soak client's).

use std::fmt;

mod chain;

pub use chain::error_chain;

/// One invalid option.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The field's path: its YAML key, nested keys joined with dots.
    pub field: String,
    /// The command-line flag that sets it (`None` for options only a file can set).
    pub flag: Option<String>,
    /// The value given, as the user would write it (`None` when no single value is at fault).
    pub value: Option<String>,
    /// What is wrong, or what is allowed ("must be a finite number in (0, 1]").
    pub message: String,
}

impl FieldError {
    /// An error on `field`; the flag is the field's last path segment with dashes
    /// (`routing.cache_threshold` → `--cache-threshold`), except under `models.` (file only).
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        let field = field.into();
        let flag = flag_of(&field);
        FieldError { field, flag, value: None, message: message.into() }
    }

    /// The value that was given.
    pub fn got(mut self, value: impl fmt::Display) -> FieldError {
        self.value = Some(value.to_string());
        self
    }

    /// A flag other than the one derived from the field name (`None`: none sets it).
    pub fn with_flag(mut self, flag: Option<&str>) -> FieldError {
        self.flag = flag.map(str::to_string);
        self
    }

    /// The same error under a parent key (`models.llama` + `cache_threshold`); options nested
    /// under `models.` have no flag.
    pub fn under(mut self, parent: &str) -> FieldError {
        self.field = format!("{parent}.{}", self.field);
        if parent.starts_with("models") {
            self.flag = None;
        }
        self
    }
}

fn flag_of(field: &str) -> Option<String> {
    if field.starts_with("models.") {
        return None;
    }
    let last = field.rsplit('.').next().unwrap_or(field);
    Some(format!("--{}", last.replace('_', "-")))
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}", self.field)?;
        if let Some(flag) = &self.flag {
            write!(f, " ({flag})")?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(value) = &self.value {
            write!(f, ", got {value}")?;
        }
        Ok(())
    }
}

impl std::error::Error for FieldError {}

/// Every problem found in one configuration (never empty).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(.0))]
pub struct ValidationErrors(pub Vec<FieldError>);

fn render(errors: &[FieldError]) -> String {
    let lines: Vec<String> = errors.iter().map(|e| format!("  - {e}")).collect();
    format!("invalid configuration ({} problem{}):\n{}", errors.len(), plural(errors.len()), lines.join("\n"))
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

impl ValidationErrors {
    /// The errors, in the order found.
    pub fn errors(&self) -> &[FieldError] {
        &self.0
    }

    /// The errors, in the order found.
    pub fn iter(&self) -> std::slice::Iter<'_, FieldError> {
        self.0.iter()
    }

    /// Whether some error is about `field` (its full path).
    pub fn names(&self, field: &str) -> bool {
        self.0.iter().any(|e| e.field == field)
    }
}

impl From<FieldError> for ValidationErrors {
    fn from(error: FieldError) -> ValidationErrors {
        ValidationErrors(vec![error])
    }
}

/// Where a number must lie: `(low, high]` and the like; bounds may be infinite.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Range {
    low: f64,
    low_inclusive: bool,
    high: f64,
    high_inclusive: bool,
}

impl Range {
    /// `(0, inf)`
    pub const POSITIVE: Range = Range::new(0.0, false, f64::INFINITY, false);
    /// `[0, inf)`
    pub const NON_NEGATIVE: Range = Range::new(0.0, true, f64::INFINITY, false);
    /// `(0, 1]`
    pub const FRACTION: Range = Range::new(0.0, false, 1.0, true);
    /// `[0, 1]`
    pub const PROBABILITY: Range = Range::new(0.0, true, 1.0, true);
    /// `[1, inf)`
    pub const AT_LEAST_ONE: Range = Range::new(1.0, true, f64::INFINITY, false);

    pub const fn new(low: f64, low_inclusive: bool, high: f64, high_inclusive: bool) -> Range {
        Range { low, low_inclusive, high, high_inclusive }
    }

    /// Whether `value` is finite and inside.
    pub fn contains(&self, value: f64) -> bool {
        let above = if self.low_inclusive { value >= self.low } else { value > self.low };
        let below = if self.high_inclusive { value <= self.high } else { value < self.high };
        value.is_finite() && above && below
    }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let open = if self.low_inclusive { '[' } else { '(' };
        let close = if self.high_inclusive { ']' } else { ')' };
        let bound = |x: f64| if x.is_infinite() { "inf".to_string() } else { x.to_string() };
        write!(f, "{open}{}, {}{close}", bound(self.low), bound(self.high))
    }
}

/// Collects every problem of one configuration.
#[derive(Debug, Default)]
pub struct Checks {
    errors: Vec<FieldError>,
}

impl Checks {
    pub fn new() -> Checks {
        Checks::default()
    }

    /// Record a problem.
    pub fn push(&mut self, error: FieldError) {
        self.errors.push(error);
    }

    /// Record several problems (e.g. a nested configuration's, already under their parent).
    pub fn extend(&mut self, errors: impl IntoIterator<Item = FieldError>) {
        self.errors.extend(errors);
    }

    /// Record the problems of a nested validation, if it failed.
    pub fn nested(&mut self, result: Result<(), ValidationErrors>) {
        if let Err(errors) = result {
            self.errors.extend(errors.0);
        }
    }

    /// `value` must be a finite number in `range`.
    pub fn in_range(&mut self, field: &str, value: f64, range: Range) {
        if !range.contains(value) {
            self.push(FieldError::new(field, format!("must be a finite number in {range}")).got(value));
        }
    }

    /// `value` must be at least `min`.
    pub fn at_least(&mut self, field: &str, value: u64, min: u64) {
        if value < min {
            self.push(FieldError::new(field, format!("must be at least {min}")).got(value));
        }
    }

    /// Record `message` on `field` unless `ok`.
    pub fn ensure(&mut self, ok: bool, field: &str, message: impl Into<String>) {
        if !ok {
            self.push(FieldError::new(field, message));
        }
    }

    /// Whether nothing was found so far.
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// `Ok` when nothing was found, else every problem.
    pub fn finish(self) -> Result<(), ValidationErrors> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(ValidationErrors(self.errors))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_names_field_flag_value_and_range() {
        let mut checks = Checks::new();
        checks.in_range("routing.cache_threshold", 1.5, Range::FRACTION);
        checks.in_range("request_timeout_secs", f64::NAN, Range::POSITIVE);
        checks.in_range("eviction_interval", f64::INFINITY, Range::POSITIVE);
        checks.at_least("health_failure_threshold", 0, 1);
        checks.in_range("balance_rel_threshold", 1.0, Range::AT_LEAST_ONE);
        let errors = checks.finish().unwrap_err();
        let text = errors.to_string();
        assert!(text.starts_with("invalid configuration (4 problems):"), "{text}");
        assert!(
            text.contains("invalid routing.cache_threshold (--cache-threshold): must be a finite number in (0, 1], got 1.5"),
            "{text}"
        );
        assert!(text.contains(
            "request_timeout_secs (--request-timeout-secs): must be a finite number in (0, inf), got NaN"
        ));
        assert!(text.contains("got inf"));
        assert!(
            text.contains("health_failure_threshold (--health-failure-threshold): must be at least 1, got 0")
        );
        assert!(errors.names("routing.cache_threshold") && !errors.names("balance_rel_threshold"));
    }

    #[test]
    fn options_under_models_have_no_flag() {
        let error = FieldError::new("cache_threshold", "must be a finite number in (0, 1]")
            .got(2)
            .under("models.llama");
        assert_eq!(error.field, "models.llama.cache_threshold");
        assert_eq!(
            error.to_string(),
            "invalid models.llama.cache_threshold: must be a finite number in (0, 1], got 2"
        );
    }

    #[test]
    fn ranges_print_as_intervals() {
        assert_eq!(Range::FRACTION.to_string(), "(0, 1]");
        assert_eq!(Range::NON_NEGATIVE.to_string(), "[0, inf)");
        assert!(Range::PROBABILITY.contains(0.0) && !Range::FRACTION.contains(0.0));
        assert!(!Range::NON_NEGATIVE.contains(f64::INFINITY));
    }
}
