//! `strftime_now(format)`: the template global that dates a system prompt (Llama 3's templates
//! do), the current time in UTC formatted by jiff with C's `strftime` directives: the POSIX locale's
//! `%c`, `%x`, `%X` and `%r`, glibc's flags (`%-d`: no padding), and unknown directives kept as
//! written, as glibc (and so Python) does.

use jiff::fmt::strtime::{BrokenDownTime, Config, PosixCustom};
use jiff::tz::TimeZone;
use jiff::Timestamp;

/// The template global `strftime_now`. transformers formats the engine host's local time
/// (`datetime.now()`, UTC in the usual engine container); the gateway uses UTC, so on a host
/// set to another zone prompts rendered around midnight may differ by a day.
pub(crate) fn strftime_now(format: &str) -> String {
    strftime(format, Timestamp::now())
}

/// Formats `at` in UTC with `format`.
fn strftime(format: &str, at: Timestamp) -> String {
    let config = Config::new().custom(PosixCustom::new()).lenient(true);
    // Lenient formatting writes what it cannot format as it stands: it fails only on a failing
    // writer, and a String never fails.
    BrokenDownTime::from(&at.to_zoned(TimeZone::UTC))
        .to_string_with_config(&config, format)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(unix_seconds: i64) -> Timestamp {
        Timestamp::from_second(unix_seconds).unwrap()
    }

    #[test]
    fn formats_like_c_strftime() {
        // 2024-07-26 13:05:09 UTC, a Friday (Python: datetime(2024, 7, 26, 13, 5, 9).strftime(...)).
        let moment = at(1_721_999_109);
        assert_eq!(strftime("%d %b %Y", moment), "26 Jul 2024");
        assert_eq!(
            strftime("%A, %B %-d, %Y %H:%M:%S %p %j", moment),
            "Friday, July 26, 2024 13:05:09 PM 208"
        );
        assert_eq!(strftime("%F %T %y %I %a %% %K", moment), "2024-07-26 13:05:09 24 01 Fri % %K");
        assert_eq!(
            strftime("%c|%D %e %u %w %z %Z", moment),
            "Fri Jul 26 13:05:09 2024|07/26/24 26 5 5 +0000 UTC"
        );
        assert_eq!(strftime("%x %X %r %h", moment), "07/26/24 13:05:09 01:05:09 PM Jul");
        assert_eq!(strftime("%Y-%m-%d", at(0)), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %j %e", at(951_782_400)), "2000-02-29 060 29");
        assert_eq!(strftime("%Y-%m-%d %-e|%e", at(-86_400 * 30)), "1969-12-02 2| 2");
        assert_eq!(strftime("100%", moment), "100%");
        assert!(!strftime_now("%Y").is_empty());
    }
}
